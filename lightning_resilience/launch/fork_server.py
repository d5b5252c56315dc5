"""``python -u .../launch/fork_server.py LISTEN_FD STOP_FD ENV_JSON -- [-m MODULE | SCRIPT] [args]``: one standby
worker of ``lightning-resilience launch``, for one local rank.

It imports what the script imports (:func:`preimport.prepare`: torch, Lightning, the script's own modules) in the
environment this local rank will have (the launcher predicts the rank's variables: ``ENV_JSON``), then waits. When
torchrun starts the rank, the rank's wrapper (:mod:`.worker`) connects and sends its argv, environment, working
directory and standard streams; unless the request must be declined (:func:`preimport.decline_reason`: the rank
then starts cold and says why), this process forks, and the child becomes the rank: the rank's environment exactly
(with what the imports changed in it), its working directory, its streams, a process group of its own, then the
script as ``__main__`` (:func:`worker.run_here`). The wrapper stands in for the child towards torchrun: it passes the
signals it gets on, and ends as the child ended, which this process (the child's parent) reports. The child does not
pay the imports: a restart does not either. Python's ``random`` reseeds itself in a forked child, NumPy's global
generator is reseeded here; objects of the imports are frozen (``gc.freeze``), so the child's collections and its
exit skip them. A variable of the rank the imports read with another value is learnt: this process starts over
(exec) with the rank's value, for the next attempt.

Owned and bounded: it ends when the launcher closes ``STOP_FD`` (or dies: ``PR_SET_PDEATHSIG``), SIGKILLs any child
still running first; a child gets SIGKILL when this process dies, and its process group gets SIGKILL when its
stand-in (torchrun's process) is gone. Run as a file, standard library only until the script's imports.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.util
import json
import os
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_resilience.launch.preimport import Prepared

__all__ = ["main"]

_REQUEST_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 10.0
_TICK_S = 1.0
_PR_SET_PDEATHSIG = 1


def _say(message: str) -> None:
    print(f"lightning-resilience launch: standby worker {os.environ.get('LOCAL_RANK', '?')}: {message}",
          file=sys.stderr, flush=True)  # fmt: skip


def _load(name: str) -> ModuleType:
    """A module beside this file (``worker``, ``preimport``), under a name of its own: this folder is not on
    sys.path, and importing our package would import Lightning, which the script may not."""
    spec = importlib.util.spec_from_file_location(
        f"_lightning_resilience_launch_{name}", Path(__file__).with_name(f"{name}.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclass
class _Child:
    pid: int
    conn: socket.socket


class _Server:
    """The loop of the standby worker: accept a rank, fork it, report its end to its stand-in. One thread."""

    def __init__(
        self, listener: socket.socket, stop_fd: int, prepared: Prepared, worker: ModuleType, preimport: ModuleType
    ) -> None:
        self.listener, self.stop_fd, self.prepared, self.worker = listener, stop_fd, prepared, worker
        self.decline_reason = preimport.decline_reason
        self.children: dict[int, _Child] = {}
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        self.learnt: dict[str, str] = {}
        self.again = False

    def serve(self) -> tuple[dict[str, Any], list[int]] | None:
        """Until the launcher says stop: None. In a forked child: its request and its streams."""
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # the wakeup fd carries it to the loop
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "reap")
        self.selector.register(self.stop_fd, selectors.EVENT_READ, "stop")
        while True:
            for key, _ in self.selector.select(timeout=_TICK_S):
                if key.data == "accept":
                    forked = self._accept()
                    if forked is not None:
                        return forked
                elif key.data == "reap":
                    with contextlib.suppress(OSError):
                        os.read(self.wake_r, 4096)
                elif key.data == "stop":
                    if not os.read(self.stop_fd, 4096):
                        self._stop()
                        return None
                else:
                    self._stand_in_gone(key.data)
            self._reap()
            if self.again and not self.children:
                self._relearn()

    def _accept(self) -> tuple[dict[str, Any], list[int]] | None:
        conn, _ = self.listener.accept()
        fds: list[int] = []
        try:
            conn.settimeout(_REQUEST_TIMEOUT_S)
            if self.worker.peer_uid(conn) != os.getuid():
                conn.close()
                return None
            _, fds, _, _ = socket.recv_fds(conn, 1, 3)
            request = self.worker.receive(conn)
            if request is None:
                raise OSError("the rank's wrapper closed the connection")
            why, again = self.decline_reason(self.prepared, request)
            if why is not None:
                self.worker.send(conn, {"declined": why})
                if again is not None:
                    self.learnt.update(again)
                    self.again = True
                raise OSError(why)
        except (OSError, ValueError) as err:
            for fd in fds:
                os.close(fd)
            conn.close()
            _say(f"rank not taken: {err}")
            return None
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        gc.freeze()  # what this loop made too: the child's collections skip it
        pid = os.fork()
        if pid == 0:
            self._leave(conn)
            return request, fds
        for fd in fds:
            os.close(fd)
        try:
            self.worker.send(conn, {"pid": pid})
        except OSError:
            pass  # its stand-in is gone: the selector says so next
        self.children[pid] = _Child(pid, conn)
        self.selector.register(conn, selectors.EVENT_READ, self.children[pid])
        return None

    def _relearn(self) -> None:
        """Start over (exec) with the learnt values: this process cannot forget its imports."""
        _say(f"importing again{''.join(f' {k}={v}' for k, v in sorted(self.learnt.items()))}")
        predicted = {**json.loads(sys.argv[3]), **self.learnt}
        argv = list(sys.orig_argv)
        argv[argv.index(sys.argv[0]) + 3] = json.dumps(predicted)
        os.set_inheritable(self.listener.fileno(), True)
        os.set_inheritable(self.stop_fd, True)
        os.execv(sys.executable, argv)

    def _stand_in_gone(self, child: _Child) -> None:
        """torchrun's process for the child ended (or closed the connection): nothing may outlive it."""
        try:
            data = child.conn.recv(1)
        except OSError:
            data = b""
        if data:
            return
        self.selector.unregister(child.conn)
        with contextlib.suppress(OSError):
            os.killpg(child.pid, signal.SIGKILL)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None:
                continue
            with contextlib.suppress(OSError, ValueError):
                self.worker.send(child.conn, {"status": status})
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(child.conn)
            child.conn.close()

    def _stop(self) -> None:
        """The launcher is done: no child outlives this process (a bounded wait, then SIGKILL)."""
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for pid in list(self.children):
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        while self.children and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.05)

    def _leave(self, conn: socket.socket) -> None:
        """In the forked child: drop everything of the server (and end if the stand-in already gave up waiting)."""
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            if conn.recv(1, socket.MSG_PEEK) == b"":
                os._exit(1)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.selector.close()
        for child in self.children.values():
            child.conn.close()
        self.children.clear()
        conn.close()
        self.listener.close()
        for fd in (self.wake_r, self.wake_w, self.stop_fd):
            os.close(fd)


def _become(request: dict[str, Any], streams: list[int], prepared: Prepared, server_pid: int) -> None:
    """In the forked child: become the rank of ``request`` (its environment, directory, streams, group)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server_pid:  # the server died before the line above
        os._exit(1)
    os.setpgid(0, 0)  # a group of its own: SIGKILLed whole (loader workers too) when its stand-in is gone
    for target, fd in zip(request["streams"], streams, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    for target in {0, 1, 2} - set(request["streams"]):
        with contextlib.suppress(OSError):
            os.close(target)
    os.chdir(request["cwd"])
    env = dict(request["env"])
    for name, value in prepared.changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    os.environ.clear()
    os.environ.update(env)
    sys.orig_argv[:] = request.get("orig_argv") or sys.orig_argv
    if request.get("affinity") and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, request["affinity"])
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()  # as a cold start's import would have seeded it
    gc.enable()


def main() -> tuple[dict[str, Any], list[int], Prepared, ModuleType] | None:
    gc.disable()  # no collection in the imports: the pages a child shares stay as they are
    started = time.monotonic()
    listen_fd, stop_fd, predicted, argv = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[5:]
    worker, preimport = _load("worker"), _load("preimport")
    prepared = preimport.prepare(argv, predicted, worker)
    gc.freeze()
    failed = f"; not importable here: {', '.join(prepared.failed[:5])}" if prepared.failed else ""
    state = f"cannot be used: {prepared.hazard}" if prepared.hazard else "ready"
    _say(f"{state} ({len(sys.modules)} modules imported in {time.monotonic() - started:.1f} s{failed})")
    listener = socket.socket(fileno=listen_fd)
    served = _Server(listener, stop_fd, prepared, worker, preimport).serve()
    if served is None:
        return None
    return (*served, prepared, worker)


if __name__ == "__main__":
    server_pid = os.getpid()
    forked = main()
    if forked is None:
        sys.exit(0)
    request_, streams_, prepared_, worker_ = forked
    _become(request_, streams_, prepared_, server_pid)
    worker_.run_here(request_["argv"], start="standby")  # ends as the script ends: exit status, exception, signal
