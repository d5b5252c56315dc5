"""Snapshot buffers in node-local shared memory, so that the newest snapshots outlive the worker process.

A rank's buffers are files under ``<shm_dir>/lightning_resilience_snapshots/<run key>/rank_NNNNN/`` (``/dev/shm``
by default, a RAM-backed tmpfs), each mapped once into the training process and reused from step to step: the
snapshot copy writes straight into them, so keeping a step in shared memory costs no copy beyond the snapshot
itself. A buffer holds one step once a small *marker* (``<buffer>.json``: step, tensor layout, skeleton, metadata,
and the buffer's *generation*) is committed next to it, after its copy has landed (written under a temporary name,
then renamed). Before the buffer is written again its generation, kept in the buffer's own header, is bumped: a
store to memory, no system call on the training thread, and from then on the marker names a generation the buffer
no longer has. A process killed at any instant therefore leaves every buffer either whole with a marker of its
generation, or with none, never a torn snapshot that looks whole.

A restarted worker on the same node (same run key, same rank) finds the marked buffers of its dead predecessor
(:func:`scan`) and maps them read-only to restore. The run key names the run across restarts
(:func:`resolve_run_key`); buffers of another run key are never read, and those that a finished or crashed job
left behind are swept once no process of theirs is alive and they are older than :data:`STALE_AFTER_S`.

Space is taken with ``posix_fallocate`` when a buffer is created, so a full ``/dev/shm`` is an ``OSError`` there
(the tier then keeps its buffers in process memory), never a ``SIGBUS`` in the middle of a copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import mmap
import os
import re
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from lightning_resilience.checkpoint.filesystems import existing_ancestor
from lightning_resilience.rundir import RUN_DIR_ENV

__all__ = [
    "FORMAT",
    "HEADER",
    "STALE_AFTER_S",
    "Held",
    "Segment",
    "held_steps",
    "map_held",
    "process_identity",
    "rank_directory",
    "resolve_run_key",
    "scan",
    "sweep_stale_runs",
    "vouches",
]

log = logging.getLogger(__name__)

FORMAT = "lightning_resilience/shm-v1"
SUBDIR = "lightning_resilience_snapshots"
"""Under the shared-memory directory: one directory per run key (the peer tier's ``lightning_resilience/`` is apart)."""
_RUN_KEY = re.compile(r"^(run|launch|slurm|torchelastic|agent)-[A-Za-z0-9_.-]*-[0-9a-f]{16}$")
STALE_AFTER_S = 600.0
"""Buffers of another run are removed only when no process that wrote them is alive and the newest of them is older
than this: a job of another run restarting on the same node keeps its buffers across its restart gap."""
ALIGN = 64
HEADER = 64
"""Bytes before a buffer's data: a magic word and the buffer's generation (:data:`_HEAD`)."""
_HEAD = struct.Struct("<8sQ")
_MAGIC = b"LRSHM\x00v1"
_BUFFER = re.compile(r"^buf-(\d+)-(\d+)-(\d+)\.bin$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_SEGMENTS = itertools.count()


# ----------------------------------------------------------------------------------------------- run identity
def resolve_run_key(explicit: str = "") -> tuple[str, str] | None:
    """The key that names this run across restarts, and where it came from; None when nothing identifies it.

    In order: ``explicit`` (the tier's ``run_id``); ``lightning-resilience launch``'s run directory (the same for
    every attempt of the run, requeues included); the scheduler's job id (``SLURM_JOB_ID``, kept by a requeue);
    torchrun's ``TORCHELASTIC_RUN_ID`` when set with ``--rdzv-id`` (torchrun's default ``none`` names nothing);
    the torchrun agent itself (its pid and start time: its restarts of the workers are one run).
    """
    env = os.environ
    if explicit:
        return _key("run", explicit), f"run_id={explicit!r}"
    launch_dir = env.get(RUN_DIR_ENV)
    if launch_dir:
        return _key("launch", launch_dir), f"the launcher's run directory {launch_dir}"
    if env.get("SLURM_JOB_ID"):
        return _key("slurm", env["SLURM_JOB_ID"]), f"SLURM_JOB_ID={env['SLURM_JOB_ID']}"
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return _key("torchelastic", run_id), f"TORCHELASTIC_RUN_ID={run_id}"
    if env.get("TORCHELASTIC_RESTART_COUNT") is not None:
        agent = os.getppid()
        started = _start_time(agent)
        if started is not None:
            return _key("agent", f"{agent}-{started}"), f"the torchrun agent (pid {agent})"
    return None


def _key(kind: str, value: str) -> str:
    digest = hashlib.sha1(value.encode()).hexdigest()[:16]
    return f"{kind}-{_UNSAFE.sub('_', value)[-24:].strip('_.')}-{digest}"


def _start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (Linux), which tells a live process from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: fields are counted after its closing one
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def process_identity() -> tuple[int, int]:
    """This process's pid and start time (see :func:`_start_time`)."""
    pid = os.getpid()
    return pid, _start_time(pid) or 0


def _alive(pid: int, started: int) -> bool:
    return _start_time(pid) == started if started else Path(f"/proc/{pid}").exists()


def rank_directory(shm_dir: Path, run_key: str, rank: int) -> Path:
    return shm_dir / SUBDIR / run_key / f"rank_{rank:05d}"


def free_bytes(path: Path) -> int:
    """Bytes a new buffer may take in the filesystem of ``path`` (its nearest existing ancestor)."""
    return shutil.disk_usage(existing_ancestor(path)).free


# --------------------------------------------------------------------------------------------------- segments
class Segment:
    """One buffer file, mapped into this process, and its marker.

    Args:
        directory: the rank's directory (created if missing).
        nbytes: size of the buffer.
        pin: register the mapping with CUDA (page-locked, for asynchronous device-to-host copies).

    Raises:
        OSError: the filesystem has no room (``posix_fallocate``), or the directory cannot be written.
    """

    def __init__(self, directory: Path, nbytes: int, *, pin: bool = False) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        pid, started = process_identity()
        self.path = directory / f"buf-{pid}-{started}-{next(_SEGMENTS)}.bin"  # never another buffer's name
        self.marker = self.path.with_suffix(".json")
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._generation = 0
        self._pinned = False
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, HEADER + nbytes)  # the pages exist now: a full tmpfs is an error here
            # mapped by torch, which keeps no descriptor open (Python's mmap keeps a duplicate: a descriptor a buffer)
            mapped = torch.from_file(str(self.path), shared=True, size=HEADER + nbytes, dtype=torch.uint8)
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self._head = cast(Any, mapped[:HEADER].numpy())  # the header, written in place
        _HEAD.pack_into(self._head, 0, _MAGIC, 0)  # the generation of a fresh buffer
        self.data = mapped[HEADER:] if nbytes else torch.empty(0)
        if pin and nbytes and torch.cuda.is_available():
            # the copy from the device lands here directly: page-locked like a pinned torch allocation
            self._pinned = _page_lock(self, self.data.data_ptr(), nbytes)

    def __repr__(self) -> str:
        return f"Segment({self.path}, {self.nbytes} bytes)"

    @property
    def pinned(self) -> bool:
        return self._pinned

    @property
    def base(self) -> int:
        """Where the arena starts in the file."""
        return HEADER

    def invalidate(self) -> int:
        """Before the buffer is written again: a new generation in its header, so that its marker no longer vouches
        for it (a store to memory, no system call). Returns the generation a :meth:`commit` must name."""
        with self._lock:
            self._generation += 1
            _HEAD.pack_into(self._head, 0, _MAGIC, self._generation)
            return self._generation

    def commit(self, generation: int, marker: dict[str, Any]) -> bool:
        """Write the marker that makes the buffer's content a whole step; False when the buffer was invalidated
        since ``generation`` (its content is no longer that step)."""
        text = json.dumps(
            {"format": FORMAT, "data": self.path.name, "nbytes": self.nbytes, "generation": generation, **marker}
        )
        with self._lock:
            if generation != self._generation:
                return False
            tmp = self.marker.with_name(f".{self.marker.name}.tmp")
            tmp.write_text(text)
            os.replace(tmp, self.marker)  # tmpfs: no fsync; a rename is atomic and a kill cannot undo it
            return True

    def remove(self) -> None:
        """Unlink the buffer and its marker; the mapping stays valid for the tensors that still view it."""
        with self._lock:
            self._generation += 1
            _HEAD.pack_into(self._head, 0, _MAGIC, self._generation)
            self.marker.unlink(missing_ok=True)
            self.path.unlink(missing_ok=True)
        if self._pinned:
            with contextlib.suppress(Exception):  # page-locking is an optimisation; never fail a teardown on it
                torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self._pinned = False


def _page_lock(segment: Segment, ptr: int, nbytes: int) -> bool:
    """``cudaHostRegister`` the mapping; on a refusal the buffer stays usable (copies to it are synchronous).

    Linux refuses a long-term writable pin of the pages of a file on a disk filesystem (tmpfs such as ``/dev/shm`` is
    fine), so ``shm_dir`` on a disk is the usual cause. The refusal stays behind as the CUDA runtime's *last error*,
    which the next kernel launch would report as its own failure: it is taken off here.
    """
    status = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
    if status == 0:
        return True
    _clear_last_cuda_error()
    log.warning(
        "could not page-lock %s (cudaHostRegister error %d; a buffer directory on a disk filesystem rather than a "
        "tmpfs such as /dev/shm is the usual cause: see shm_dir): copies to it are synchronous",
        segment,
        status,
    )
    return False


def _clear_last_cuda_error() -> None:
    """``cudaGetLastError`` of the runtime torch loaded (read off the process's mappings); where none is found, one
    tiny kernel launch takes the pending error and its report is dropped."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # no /proc, or a runtime without the symbol: the fallback
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.rsplit(" ", 1)[-1]
            if os.path.basename(path).startswith("libcudart.so"):
                ctypes.CDLL(path).cudaGetLastError()
                return
    with contextlib.suppress(RuntimeError):
        torch.empty(1, device="cuda").zero_()


# ------------------------------------------------------------------------------------------------ what is held
@dataclass(frozen=True)
class Held:
    """A marked buffer left by another process of this run and rank: one whole step."""

    step: int
    marker: Path
    data: Path
    world_size: int
    nbytes: int
    written: float


def scan(directory: Path, *, world_size: int) -> tuple[list[Held], list[Path]]:
    """The whole steps in ``directory`` that other (dead) processes wrote, and the files to remove now: buffers
    without a marker, markers without a buffer, and steps of another world size.

    Files of a process that is still alive are neither listed nor removed (a zombie of the previous attempt might
    still write them).
    """
    held: list[Held] = []
    doomed: list[Path] = []
    if not directory.is_dir():
        return held, doomed
    me = process_identity()
    for entry in sorted(directory.iterdir()):
        match = _BUFFER.match(entry.name)
        if match is None:
            if entry.name.endswith(".tmp") or (entry.suffix == ".json" and not entry.with_suffix(".bin").exists()):
                doomed.append(entry)
            continue
        owner = (int(match.group(1)), int(match.group(2)))
        if owner == me or _alive(*owner):
            continue
        marker = entry.with_suffix(".json")
        info = _read_marker(marker, entry)
        if info is None:  # never committed, or written again since its marker (a kill in the middle of a copy)
            doomed += [entry, marker]
        elif int(info["world_size"]) != world_size:
            log.info("removing %s: written by a job of world size %s, this one has %d", entry, info["world_size"],
                     world_size)  # fmt: skip
            doomed += [entry, marker]
        else:
            held.append(Held(int(info["step"]), marker, entry, world_size, int(info["nbytes"]), marker.stat().st_mtime))
    return held, doomed


def _read_marker(marker: Path, data: Path) -> dict[str, Any] | None:
    """The marker of ``data`` when it vouches for the buffer as it is: same name, size, and generation."""
    try:
        info: dict[str, Any] = json.loads(marker.read_text())
        if info.get("format") != FORMAT or info.get("data") != data.name:
            return None
        with open(data, "rb") as f:
            magic, generation = _HEAD.unpack(f.read(_HEAD.size))
            size = os.fstat(f.fileno()).st_size
        if magic == _MAGIC and generation == int(info["generation"]) and size >= HEADER + int(info["nbytes"]):
            return info
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        pass
    return None


def held_steps(shm_dir: Path, run_key: str) -> dict[int, list[int]]:
    """Step -> ranks holding it whole in shared memory (markers of processes no longer alive), for every rank of
    the run on this node: what a restart finds before it touches anything."""
    out: dict[int, set[int]] = {}
    root = shm_dir / SUBDIR / run_key
    for rank_dir in sorted(root.glob("rank_*")) if root.is_dir() else []:
        rank = int(rank_dir.name.removeprefix("rank_"))
        for entry in rank_dir.iterdir():
            match = _BUFFER.match(entry.name)
            if match is None or _alive(int(match.group(1)), int(match.group(2))):
                continue
            info = _read_marker(entry.with_suffix(".json"), entry)
            if info is not None:
                out.setdefault(int(info["step"]), set()).add(rank)
    return {step: sorted(ranks) for step, ranks in sorted(out.items())}


def vouches(held: Held) -> bool:
    """``held``'s marker still vouches for its buffer (both there, the same generation)."""
    return _read_marker(held.marker, held.data) is not None


def map_held(held: Held) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The marker of ``held`` and its tensors, read-only views of the mapped buffer (the caller copies them).

    Raises:
        OSError: the buffer or its marker is gone.
        ValueError: the marker does not describe the buffer.
    """
    info = _read_marker(held.marker, held.data)
    if info is None:
        raise ValueError(f"{held.marker}: not a marker of {held.data.name}")
    with open(held.data, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mapping = mmap.mmap(f.fileno(), max(size, 1), mmap.MAP_SHARED, mmap.PROT_READ) if size else None
    tensors = {}
    for name, (offset, shape, dtype) in info["tensors"].items():
        tensors[name] = tensor_view(mapping, HEADER + int(offset), tuple(shape), _dtype(str(dtype)))
    return info, tensors


def tensor_view(buffer: Any, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over ``buffer`` (anything with the buffer protocol) at ``offset``."""
    count = 1
    for d in shape:
        count *= d
    if count == 0 or buffer is None:
        return torch.empty(shape, dtype=dtype)
    with _quiet_readonly():
        return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).view(shape)


@contextlib.contextmanager
def _quiet_readonly() -> Any:
    import warnings

    with warnings.catch_warnings():  # a read-only mapping: torch warns that the tensor is not writable
        warnings.filterwarnings("ignore", message=".*not writable.*")
        yield


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a shared-memory marker")
    return dtype


# ------------------------------------------------------------------------------------------------- clean-ups
def remove_files(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def sweep_stale_runs(shm_dir: Path, keep: str, *, now: float | None = None) -> list[Path]:
    """Remove the directories that other runs left under ``shm_dir`` once they are stale (every writer dead, the
    newest file older than :data:`STALE_AFTER_S`); ``keep`` is this run's key. Returns what was removed."""
    root = shm_dir / SUBDIR
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    removed = []
    for run in root.iterdir():
        if run.name == keep or not run.is_dir() or not _RUN_KEY.match(run.name):
            continue  # only what this module names: never another directory that happens to be there
        try:
            files = [f for rank in run.iterdir() if rank.is_dir() for f in rank.iterdir()]
            newest = max((f.stat().st_mtime for f in files), default=run.stat().st_mtime)
        except OSError:
            continue  # another job is changing it right now: not stale
        writers = {(int(m.group(1)), int(m.group(2))) for f in files if (m := _BUFFER.match(f.name))}
        if now - newest < STALE_AFTER_S or any(_alive(*w) for w in writers):
            continue
        shutil.rmtree(run, ignore_errors=True)
        removed.append(run)
    if removed:
        log.info("removed snapshot buffers that earlier jobs left in %s: %s", root, [r.name for r in removed])
    return removed


def align(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN
