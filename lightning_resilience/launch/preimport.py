"""What a standby worker imports, and whether a rank may run in a fork of it (see :mod:`.fork_server`).

:func:`prepare` imports what the script imports at its top level (torch, Lightning, the script's own modules; not what
its functions import) in the environment the rank will have, noting which of the rank's own variables the imports read
and what they changed in the environment. :func:`decline_reason` compares a rank's request with that: a fork is exact
only where a cold start would have seen the same thing.

Standard library only: loaded by path by the fork server, which runs as a file.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["PER_WORKER_ENV", "Prepared", "decline_reason", "prepare", "script_imports"]

PER_WORKER_ENV = frozenset(
    {
        "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
        "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "CUDA_VISIBLE_DEVICES",
    }
)  # fmt: skip
"""What torchrun's agent sets for each worker (and, by prefix, ``TORCHELASTIC_*`` and the launcher's own)."""
_PER_WORKER_PREFIXES = ("TORCHELASTIC_", "LIGHTNING_RESILIENCE_")


def _per_worker(name: str) -> bool:
    return name in PER_WORKER_ENV or name.startswith(_PER_WORKER_PREFIXES)


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


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _fork_hazard() -> str | None:
    """Why a fork of this process would not be a faithful copy, or None. Threads a library stops for a fork (its
    ``pthread_atfork`` handler: OpenBLAS's thread pool) do no harm: a trial fork tells them from the others."""
    if _threads() > 1:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    threads = _threads()
    if threads > 1:
        return f"the imports left {threads - 1} threads running (a fork copies only this one)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the imports initialised CUDA (a forked child cannot use it)"
    if _cuda_driver_loaded():
        return ("the imports loaded the CUDA driver (a forked child cannot use it; a module-level "
                "torch.cuda.is_available() does, unless PYTORCH_NVML_BASED_CUDA_CHECK=1)")  # fmt: skip
    return None


def _cuda_driver_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:
        return False


@dataclass
class Prepared:
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
    sources: dict[str, int] = field(default_factory=dict)
    """The files of the imported modules and their modification times: a rank runs the code on disk now."""


def _sources() -> dict[str, int]:
    out = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str):
            with contextlib.suppress(OSError):
                out[path] = os.stat(path).st_mtime_ns
    return out


def _changed(sources: Mapping[str, int]) -> str | None:
    for path, mtime in sources.items():
        try:
            if os.stat(path).st_mtime_ns != mtime:
                return path
        except OSError:
            return path
    return None


def decline_reason(prepared: Prepared, request: dict[str, Any]) -> tuple[str | None, dict[str, str] | None]:
    """Why the rank of ``request`` must not run in a fork of this process (None: it may); and, when the imports must
    be made again for the next attempt, the rank's values of the variables they should see (else None)."""
    if prepared.hazard:
        return prepared.hazard, None
    if request.get("interpreter") != prepared.interpreter:
        return "the rank's interpreter or its flags differ from the standby worker's", None
    argv = request.get("argv") or []
    if argv[: 2 if argv[:1] == ["-m"] else 1] != prepared.argv[: 2 if prepared.argv[:1] == ["-m"] else 1]:
        return "another script than the standby worker imported for", None
    if request.get("cwd") != prepared.cwd:
        return "another working directory than the standby worker's", None
    env: dict[str, str] = request.get("env") or {}
    differ = sorted(
        k for k in env.keys() | prepared.environ.keys() if not _per_worker(k) and env.get(k) != prepared.environ.get(k)
    )
    if differ:
        return f"the environment differs from the standby worker's in {', '.join(differ[:8])}", None
    changed = _changed(prepared.sources)
    if changed:
        return f"{changed} changed since the standby worker imported it; importing again", {}
    seen = sorted(k for k in prepared.per_worker_reads if env.get(k) != prepared.environ.get(k))
    if seen:
        learnt = {k: env[k] for k in seen if k in PER_WORKER_ENV and k in env}  # not what changes every attempt
        said = ", ".join(f"{k}={env.get(k)!r} (imported with {prepared.environ.get(k)!r})" for k in seen)
        if learnt:
            return f"the imports read {said}; importing again with the rank's values", learnt
        return f"the imports read {said}", None
    return None, None


def prepare(argv: list[str], predicted: dict[str, str], worker: ModuleType) -> Prepared:
    """Import what ``argv``'s script imports, in this environment with the ``predicted`` variables of the rank."""
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
    return Prepared(
        argv=argv,
        interpreter=worker.interpreter(),
        cwd=os.getcwd(),
        environ=before,
        changes=changes,
        per_worker_reads={k for k in reads if _per_worker(k)},
        hazard=_fork_hazard(),
        failed=failed,
        sources=_sources(),
    )
