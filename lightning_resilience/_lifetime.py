"""A child process's lifetime tied to its parent's: the kernel signals it when the parent dies (Linux)."""

from __future__ import annotations

import ctypes
import signal

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """In a child: get ``sig`` when the thread that forked it dies (``PR_SET_PDEATHSIG``). Returns whether it is
    armed (False where there is no ``prctl``: not Linux). Check ``os.getppid()`` afterwards where the parent may
    already have died before it was armed."""
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False
