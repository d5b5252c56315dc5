"""A child process's lifetime tied to its parent's: the kernel signals it when the parent dies (Linux), and a parent
that ends takes its daemonic children with it, even one that no longer answers SIGTERM."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.util  # registers its exit function first: ours, registered later, runs before it
import os
import signal
import struct
import threading
import time
from collections.abc import Callable

__all__ = ["StuckForks", "die_with_parent", "end_daemon_children", "end_daemon_children_at_exit", "stuck_forks"]

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


class StuckForks:
    """Finds this process's children that are stuck in their fork, and kills them.

    A child made by ``os.fork`` (a loader worker, a ``multiprocessing`` fork) runs the interpreter's after-fork hooks
    at once; one of them, registered here, tells the parent on a pipe. A child stuck since its fork (CPython 3.11,
    see :func:`end_daemon_children`) never does, and whoever waits for it (a loader waiting for its batches) waits
    until a watchdog's timeout. :meth:`check`, called now and then, kills a child that has not told within
    ``after_s`` of being seen, so the waiter fails at once instead (a loader raises that its worker exited).

    Only the children made by ``os.fork`` in this process are watched (the parent's hooks note them: a
    ``subprocess`` runs no hooks), and only while they still run this process's program. One per process
    (:func:`stuck_forks`): the hooks cannot be unregistered.

    Args:
        after_s: how long a child may go without telling before it is taken as stuck.
        clock: monotonic seconds.
    """

    def __init__(self, after_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.after_s = after_s
        self._clock = clock
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)  # a child never waits on a full pipe (the parent drains it)
        self._lock = threading.Lock()
        self._before: set[int] = set()
        self._forked: set[int] = set()
        self._told: set[int] = set()
        self._seen: dict[int, float] = {}
        self._program = _cmdline(os.getpid())
        os.register_at_fork(before=self._note_before, after_in_parent=self._note_after, after_in_child=self._tell)

    # the hooks: in the parent around os.fork (the forking thread holds the GIL throughout), in the child right after
    def _note_before(self) -> None:
        self._before = _children()

    def _note_after(self) -> None:
        forked = _children() - self._before
        with self._lock:
            self._forked |= forked

    def _tell(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._write, _PID.pack(os.getpid()))

    def check(self) -> list[int]:
        """Kill the children stuck in their fork for ``after_s``; returns their pids."""
        with contextlib.suppress(BlockingIOError):
            while data := os.read(self._read, 4096 * _PID.size):
                self._told.update(pid for (pid,) in _PID.iter_unpack(data[: len(data) // _PID.size * _PID.size]))
        now, stuck, children = self._clock(), [], _children()
        with self._lock:
            self._forked &= children  # pids of children gone are reused
            watched = self._forked - self._told
        for pid in watched:
            if _cmdline(pid) != self._program:  # another program now, or already gone (a zombie has none)
                continue
            seen = self._seen.setdefault(pid, now)
            if now - seen >= self.after_s:
                stuck.append(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._told &= children
        self._seen = {pid: t for pid, t in self._seen.items() if pid in watched and pid not in stuck}
        if stuck:
            log.error(
                "child processes %s have not started %.0f s after their fork (stuck in it: CPython 3.11 forking "
                "beside a native thread that takes the GIL): killed, so that whoever waits for them fails now",
                stuck,
                self.after_s,
            )
        return stuck


_PID = struct.Struct("<i")
_watch: StuckForks | None = None


def stuck_forks() -> StuckForks:
    """This process's :class:`StuckForks` (made by the first call: children forked before it are not watched)."""
    global _watch
    with _registered:
        if _watch is None:
            _watch = StuckForks()
        return _watch


def _children() -> set[int]:
    """This process's children (every thread's), from ``/proc``; none where there is no ``/proc``."""
    pids: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
                pids.update(int(pid) for pid in f.read().split())
    return pids


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
