"""A child process's lifetime tied to its parent's: the kernel signals it when the parent dies (Linux), and a parent
that ends takes its daemonic children with it, even one that no longer answers SIGTERM."""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing
import multiprocessing.util  # registers its exit function first: ours, registered later, runs before it
import signal
import threading
import time

__all__ = ["die_with_parent", "end_daemon_children", "end_daemon_children_at_exit"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_EXIT_GRACE_S = 5.0
_registered = threading.Lock()
_at_exit = False


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """In a child: get ``sig`` when the thread that forked it dies (``PR_SET_PDEATHSIG``). Returns whether it is
    armed (False where there is no ``prctl``: not Linux). Check ``os.getppid()`` afterwards where the parent may
    already have died before it was armed."""
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def end_daemon_children(grace_s: float) -> list[int]:
    """End this process's daemonic ``multiprocessing`` children still alive (loader workers, helpers): SIGTERM, and
    SIGKILL for any still alive ``grace_s`` later. Returns the pids that had to be killed.

    A daemonic child is meant to end with its parent, and ``multiprocessing`` terminates such children at exit, then
    joins them without a bound. A child forked while another thread held one of the interpreter's locks (CPython
    3.11: a native thread taking the GIL as the fork happened) is stuck before it runs any Python, with the
    parent's signal handlers: SIGTERM only sets a flag it never reads, and the parent's exit would wait forever.
    """
    children = [p for p in multiprocessing.active_children() if p.daemon]
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    killed = []
    for child in children:
        child.join(max(deadline - time.monotonic(), 0.0))
        if child.is_alive() and child.pid is not None:
            killed.append(child.pid)
            child.kill()
            child.join(1.0)
    if killed:
        log.warning(
            "daemonic child processes %s did not end on SIGTERM within %.1f s (stuck since they were forked?): killed",
            killed,
            grace_s,
        )
    return killed


def end_daemon_children_at_exit(grace_s: float = _EXIT_GRACE_S) -> None:
    """Once per process: at interpreter exit, end the daemonic children before ``multiprocessing`` joins them
    (:func:`end_daemon_children`; registered after ``multiprocessing``'s own exit function, so it runs first)."""
    global _at_exit
    with _registered:
        if not _at_exit:
            atexit.register(end_daemon_children, grace_s)
            _at_exit = True
