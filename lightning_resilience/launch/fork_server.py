"""``python -u .../launch/fork_server.py LISTEN_FD STOP_FD ENV_JSON -- [-m MODULE | SCRIPT] [args]``: one standby
worker of ``lightning-resilience launch``, for one local rank.

It imports what the script imports at its top level (torch, Lightning, the script's own modules; not what its
functions import), in the environment this local rank will have (the launcher predicts the rank's variables:
``ENV_JSON``), then waits. When torchrun starts the rank, the rank's wrapper (:mod:`.worker`) connects and sends its
argv, environment, working directory and standard streams; this process forks, and the child becomes the rank: the
rank's environment exactly, its working directory, its streams, a process group of its own, then the script as
``__main__`` (:func:`worker.run_here`). The wrapper stands in for the child towards torchrun: it passes the signals
it gets on, and ends as the child ended, which this process (the child's parent) reports. The child does not pay the
imports: a restart does not either.

A fork is exact only where a cold start would have seen the same thing, so it is declined (the rank starts cold and
says why) when: the interpreter or its flags differ; the working directory differs; a variable of the environment
differs that is not one torchrun sets per worker; a variable torchrun sets per worker (``RANK``...) was read by the
imports and its value then differs from the rank's (learnt: the next imports use the rank's value); the imports left
threads running or CUDA initialised (a fork copies neither correctly). What the imports changed in the environment is
applied on top of the rank's. Python's ``random`` reseeds itself in a forked child, NumPy's global generator is
reseeded here; objects of the imports are frozen (``gc.freeze``), so the child's collections and its exit skip them.

Owned and bounded: it ends when the launcher closes ``STOP_FD`` (or dies: ``PR_SET_PDEATHSIG``), SIGKILLs any child
still running first; a child gets SIGKILL when this process dies, and its process group gets SIGKILL when its
stand-in (torchrun's process) is gone. Run as a file, standard library only until the script's imports.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import gc
import importlib
import importlib.util
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["PER_WORKER_ENV", "main", "script_imports"]

PER_WORKER_ENV = frozenset(
    {
        "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
        "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "CUDA_VISIBLE_DEVICES",
    }
)  # fmt: skip
"""What torchrun's agent sets for each worker (and, by prefix, ``TORCHELASTIC_*`` and the launcher's own)."""
_PER_WORKER_PREFIXES = ("TORCHELASTIC_", "LIGHTNING_RESILIENCE_")
_REQUEST_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 10.0
_TICK_S = 1.0
_PR_SET_PDEATHSIG = 1


def _per_worker(name: str) -> bool:
    return name in PER_WORKER_ENV or name.startswith(_PER_WORKER_PREFIXES)


def _say(message: str) -> None:
    print(f"lightning-resilience launch: standby worker {os.environ.get('LOCAL_RANK', '?')}: {message}",
          file=sys.stderr, flush=True)  # fmt: skip


def _load_worker() -> ModuleType:
    """The rank wrapper (``worker.py`` beside this file), under a name of its own: this folder is not on sys.path."""
    spec = importlib.util.spec_from_file_location(
        "_lightning_resilience_launch_worker", Path(__file__).with_name("worker.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------- imports
def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def script_imports(argv: list[str]) -> list[str]:
    """The modules ``[-m MODULE | SCRIPT, ...]`` imports at its top level, in order (also in top-level ``if``,
    ``try`` and ``with`` blocks; not in functions or classes, nor under ``if TYPE_CHECKING:``). ``from P import N``
    names ``P`` and, when it is one, the submodule ``P.N``."""
    if argv[0] == "-m":
        spec = importlib.util.find_spec(argv[1])  # imports the parent packages, as running the module would
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{argv[1]}.__main__")
        if spec is None or not spec.origin or not spec.has_location:
            return []
        path, package = Path(spec.origin), spec.parent or ""
    else:
        path, package = Path(argv[0]).resolve(), ""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    names: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                try:
                    base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                except (ImportError, ValueError):
                    continue
                names.append(base)
                names.extend(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
            elif isinstance(node, ast.If) and not _is_type_checking(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.With):
                visit(node.body)

    visit(tree.body)
    return list(dict.fromkeys(names))


def _import(name: str) -> str | None:
    """Import ``name``; None when done or when it is no module (an attribute of a package), else what failed."""
    try:
        parent = name.rpartition(".")[0]
        if parent and parent in sys.modules and not hasattr(sys.modules[parent], "__path__"):
            return None  # `from module import attribute`: nothing more to import
        if parent and importlib.util.find_spec(name) is None:
            return None
        importlib.import_module(name)
    except (Exception, SystemExit) as err:  # the rank will meet it again, where it belongs
        return f"{name} ({type(err).__name__})"
    return None


@contextlib.contextmanager
def _reads_of(environ: Mapping[str, str]) -> Iterator[set[str]]:
    """The names read from ``environ`` (``os.environ[...]``, ``.get``, ``in``, ``os.getenv``) inside the block."""
    cls: Any = type(environ)
    original = cls.__getitem__
    seen: set[str] = set()

    def getitem(self: Any, key: Any) -> Any:
        if self is environ and isinstance(key, str):
            seen.add(key)
        return original(self, key)

    cls.__getitem__ = getitem
    try:
        yield seen
    finally:
        cls.__getitem__ = original


def _fork_hazard() -> str | None:
    """Why a fork of this process would not be a faithful copy, or None."""
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = threading.active_count()
    if threads > 1:
        return f"the imports left {threads - 1} threads running (a fork copies only this one)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the imports initialised CUDA (a forked child cannot use it)"
    return None


# ------------------------------------------------------------------------------------------------- requests
@dataclass
class _Prepared:
    """What this process imported, and under which environment."""

    argv: list[str]
    interpreter: dict[str, Any]
    cwd: str
    environ: dict[str, str]
    """The environment the imports ran in (the launcher's and the rank's predicted variables)."""
    changes: dict[str, str | None]
    """What the imports changed in it (None: removed): applied on top of the rank's environment."""
    per_worker_reads: set[str]
    hazard: str | None
    failed: list[str] = field(default_factory=list)


def decline_reason(prepared: _Prepared, request: dict[str, Any]) -> tuple[str | None, dict[str, str]]:
    """Why the rank of ``request`` must not run in a fork of this process (None: it may), and the rank's values of
    the per-worker variables the imports read with another value (the next imports should use them)."""
    if prepared.hazard:
        return prepared.hazard, {}
    if request.get("interpreter") != prepared.interpreter:
        return "the rank's interpreter or its flags differ from the standby worker's", {}
    argv = request.get("argv") or []
    if argv[: 2 if argv[:1] == ["-m"] else 1] != prepared.argv[: 2 if prepared.argv[:1] == ["-m"] else 1]:
        return "another script than the standby worker imported for", {}
    if request.get("cwd") != prepared.cwd:
        return "another working directory than the standby worker's", {}
    env: dict[str, str] = request.get("env") or {}
    differ = sorted(
        k for k in env.keys() | prepared.environ.keys() if not _per_worker(k) and env.get(k) != prepared.environ.get(k)
    )
    if differ:
        return f"the environment differs from the standby worker's in {', '.join(differ[:8])}", {}
    seen = sorted(k for k in prepared.per_worker_reads if env.get(k) != prepared.environ.get(k))
    if seen:
        learnt = {k: env[k] for k in seen if k in PER_WORKER_ENV and k in env}  # not what changes every attempt
        said = ", ".join(f"{k}={env.get(k)!r} (imported with {prepared.environ.get(k)!r})" for k in seen)
        return f"the imports read {said}" + ("; importing again with the rank's values" if learnt else ""), learnt
    return None, {}


@dataclass
class _Child:
    pid: int
    conn: socket.socket


class _Server:
    """The loop of the standby worker: accept a rank, fork it, report its end to its stand-in. One thread."""

    def __init__(self, listener: socket.socket, stop_fd: int, prepared: _Prepared, worker: ModuleType) -> None:
        self.listener, self.stop_fd, self.prepared, self.worker = listener, stop_fd, prepared, worker
        self.children: dict[int, _Child] = {}
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        self.learnt: dict[str, str] = {}

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
            if self.learnt and not self.children:
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
            why, learnt = decline_reason(self.prepared, request)
            if why is not None:
                self.worker.send(conn, {"declined": why})
                self.learnt.update(learnt)
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
        _say(f"importing again with {', '.join(f'{k}={v}' for k, v in sorted(self.learnt.items()))}")
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
        """In the forked child: drop everything of the server."""
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


def _become(request: dict[str, Any], streams: list[int], prepared: _Prepared, server_pid: int) -> None:
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


def _prepare(argv: list[str], predicted: dict[str, str], worker: ModuleType) -> _Prepared:
    os.environ.update(predicted)
    sys.path[0] = worker.import_root(argv)  # as the rank will have it
    before = dict(os.environ)
    failed: list[str] = []
    try:
        names = script_imports(argv)
    except (Exception, SystemExit) as err:  # a script that cannot be read: its rank says why, not this process
        names, failed = [], [f"the script's own imports ({type(err).__name__}: {err})"]
    with _reads_of(os.environ) as reads:
        for name in names:
            error = _import(name)
            if error:
                failed.append(error)
    after = dict(os.environ)
    changes = {k: after.get(k) for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    return _Prepared(
        argv=argv,
        interpreter=worker.interpreter(),
        cwd=os.getcwd(),
        environ=before,
        changes=changes,
        per_worker_reads={k for k in reads if _per_worker(k)},
        hazard=_fork_hazard(),
        failed=failed,
    )


def main() -> tuple[dict[str, Any], list[int], _Prepared, ModuleType] | None:
    gc.disable()  # no collection in the imports: the pages a child shares stay as they are
    started = time.monotonic()
    listen_fd, stop_fd, predicted, argv = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[5:]
    worker = _load_worker()
    prepared = _prepare(argv, predicted, worker)
    gc.freeze()
    failed = f"; not importable here: {', '.join(prepared.failed[:5])}" if prepared.failed else ""
    state = f"cannot be used: {prepared.hazard}" if prepared.hazard else "ready"
    _say(f"{state} ({len(sys.modules)} modules imported in {time.monotonic() - started:.1f} s{failed})")
    listener = socket.socket(fileno=listen_fd)
    served = _Server(listener, stop_fd, prepared, worker).serve()
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
