"""On-disk format of one rank's shard of one checkpoint, and its validation.

A shard directory holds DCP files (tensors only: ``__0_0.distcp`` and ``.metadata``, as ``dcp.save`` lays them out,
written raw by :func:`write_shard`), ``skeleton.json`` (the non-tensor state) and ``manifest.json``, written last:
step, world size, rank layout, tensor specs, per-file size and xxh3-64 checksum, versions. A reader trusts a shard
only after every file named by the manifest exists inside the directory with the recorded size and checksum.
Nothing here unpickles arbitrary bytes: DCP's metadata is read by an allow-list unpickler.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lightning_resilience._version import __version__
from lightning_resilience.checkpoint.dcp_layout import METADATA_FILE, shard_layout
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.shard_writer import write_data_files
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tree import TensorSpec

__all__ = ["FORMAT", "MANIFEST", "Manifest", "checksum_file", "fsync_dir", "read_shard", "shard_bytes", "write_shard"]

FORMAT = "lightning_resilience/shard-v1"
MANIFEST = "manifest.json"
SKELETON = "skeleton.json"
_CHUNK = 8 << 20


@dataclass
class Manifest:
    """What a reader needs to trust and load one shard."""

    step: int
    rank: int
    world_size: int
    tensors: dict[str, TensorSpec]
    files: dict[str, dict[str, Any]]
    rank_layout: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    created: float = 0.0
    format: str = FORMAT

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": self.format,
                "step": self.step,
                "rank": self.rank,
                "world_size": self.world_size,
                "rank_layout": self.rank_layout,
                "tensors": {n: s.to_json() for n, s in self.tensors.items()},
                "files": self.files,
                "meta": self.meta,
                "versions": self.versions,
                "created": self.created,
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, *, where: str) -> Manifest:
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise CheckpointCorruptError(f"{where}: unknown manifest format {data.get('format')!r}")
            return cls(
                step=int(data["step"]),
                rank=int(data["rank"]),
                world_size=int(data["world_size"]),
                tensors={n: TensorSpec.from_json(s) for n, s in data["tensors"].items()},
                files={str(k): dict(v) for k, v in data["files"].items()},
                rank_layout=dict(data.get("rank_layout", {})),
                meta=dict(data.get("meta", {})),
                versions=dict(data.get("versions", {})),
                created=float(data.get("created", 0.0)),
            )
        except CheckpointCorruptError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointCorruptError(f"{where}: unreadable manifest ({err})") from err


def checksum_file(path: Path) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def shard_bytes(directory: Path) -> int:
    """Bytes of a committed shard on disk (its manifest included)."""
    return sum(entry.stat().st_size for entry in directory.iterdir() if entry.is_file())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_shard(
    directory: Path, snap: StagedSnapshot, *, rank: int, world_size: int, rank_layout: dict[str, Any] | None = None
) -> Manifest:
    """Write one rank's snapshot into ``directory`` (which must be new and private to the writer).

    The tensors go raw into DCP-compatible files (:mod:`~lightning_resilience.checkpoint.dcp_layout`), checksummed
    as they are written; a snapshot in shared memory with a writer process (``snap.writer``) is written by that
    process, off this one's GIL. Every file is fsynced before the manifest is written; the manifest is fsynced
    last. The caller commits the directory by renaming it (see :mod:`lightning_resilience.checkpoint.local`).
    """
    # DCP holds tensors only: its loader would unpickle non-tensor values without restriction
    layout = shard_layout({n: TensorSpec(tuple(t.shape), t.dtype) for n, t in snap.tensors.items()})
    plans = [layout.data] if snap.tensors else []
    extra = {METADATA_FILE: layout.metadata_bytes()} if snap.tensors else {}
    extra[SKELETON] = json.dumps(snap.skeleton, separators=(",", ":")).encode()
    if snap.shared is not None and snap.writer is not None:
        offsets = [snap.shared.offsets[name] for name in layout.names]
        files = snap.writer.write_files(directory, snap.shared.path, offsets, plans, extra)
    else:
        tensors = [snap.tensors[name] for name in layout.names]
        files = write_data_files(str(directory), plans, extra, lambda i: raw_bytes(tensors[i]))
    return _write_manifest(directory, snap, files, rank=rank, world_size=world_size, rank_layout=rank_layout)


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, in memory order (no copy for a contiguous tensor)."""
    if tensor.numel() == 0:
        return memoryview(b"")
    flat = tensor.detach().contiguous().reshape(-1)
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array)


def _write_manifest(
    directory: Path,
    snap: StagedSnapshot,
    files: dict[str, dict[str, Any]],
    *,
    rank: int,
    world_size: int,
    rank_layout: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    versions: dict[str, str] | None = None,
) -> Manifest:
    """Write the manifest that vouches for ``files`` (already in ``directory``, fsynced), last; fsync the
    directory."""
    manifest = Manifest(
        step=snap.step,
        rank=rank,
        world_size=world_size,
        tensors=snap.specs(),
        files=files,
        rank_layout=dict(rank_layout or {}),
        meta=dict(snap.meta if meta is None else meta),
        versions={
            "lightning_resilience": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            **(versions or {}),
        },
        created=time.time(),
    )
    write_synced(directory / MANIFEST, manifest.to_json().encode())
    fsync_dir(directory)
    return manifest


def seal_shard(
    directory: Path,
    snap: StagedSnapshot,
    *,
    meta: dict[str, Any],
    rank: int,
    world_size: int,
    rank_layout: dict[str, Any] | None = None,
    versions: dict[str, str] | None = None,
) -> Manifest:
    """Finish a shard whose data files are already in ``directory`` (fsynced): write the skeleton, checksum every
    file, and write the manifest last, which vouches for them all."""
    write_synced(directory / SKELETON, json.dumps(snap.skeleton, separators=(",", ":")).encode())
    files = {}
    for entry in sorted(directory.iterdir()):
        if entry.is_file():
            files[entry.name] = {"size": entry.stat().st_size, "xxh3_64": checksum_file(entry)}
    return _write_manifest(
        directory, snap, files, rank=rank, world_size=world_size, rank_layout=rank_layout, meta=meta, versions=versions
    )


def _inside(root: Path, name: str) -> Path:
    path = (root / name).resolve()
    if path.parent != root.resolve() or name in ("", ".", ".."):
        raise CheckpointCorruptError(f"{root}: manifest names a file outside the checkpoint directory: {name!r}")
    return path


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError as err:
        raise CheckpointCorruptError(f"{directory}: no manifest (incomplete or foreign checkpoint)") from err
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointCorruptError(f"{directory}: manifest unreadable ({err})") from err
    return Manifest.from_json(text, where=str(directory))


def validate_shard(directory: Path, *, verify_checksums: bool = True) -> Manifest:
    """Check every file the manifest names: inside the directory, right size, right checksum.

    Raises:
        CheckpointCorruptError: naming the shard and the first problem found.
    """
    manifest = read_manifest(directory)
    for name, info in manifest.files.items():
        try:
            path = _inside(directory, name)
            size = path.stat().st_size
            if size != info.get("size"):
                raise CheckpointCorruptError(
                    f"{directory}: file {name} has {size} bytes, manifest says {info.get('size')}"
                )
            if verify_checksums and checksum_file(path) != info.get("xxh3_64"):
                raise CheckpointCorruptError(f"{directory}: checksum mismatch in {name}")
        except CheckpointCorruptError:
            raise
        except FileNotFoundError as err:
            raise CheckpointCorruptError(f"{directory}: file {name} is missing") from err
        except (OSError, ValueError, RuntimeError) as err:  # NUL in the name, a directory, a symlink loop...
            raise CheckpointCorruptError(f"{directory}: manifest names an unusable file {name!r} ({err})") from err
    if SKELETON not in manifest.files:
        raise CheckpointCorruptError(f"{directory}: manifest lists no {SKELETON}")
    return manifest


def check_identity(manifest: Manifest, *, step: int, rank: int, world_size: int, where: str) -> None:
    """A shard must be the one asked for: same step and rank, written by a job of the same world size.

    Raises:
        CheckpointCorruptError: naming the shard and the mismatch.
    """
    if manifest.step != step or manifest.rank != rank:
        raise CheckpointCorruptError(
            f"{where}: manifest is for step {manifest.step} rank {manifest.rank}, expected {step} rank {rank}"
        )
    if manifest.world_size != world_size:
        raise CheckpointCorruptError(
            f"{where}: written by a job of world size {manifest.world_size}, this job has {world_size}; "
            "resume with the original world size"
        )


def read_shard(directory: Path, *, verify_checksums: bool = True) -> tuple[Manifest, StagedSnapshot]:
    """Validate and load one shard into freshly allocated host tensors.

    Raises:
        CheckpointCorruptError: the shard is missing, partial, corrupt or unreadable.
    """
    manifest = validate_shard(directory, verify_checksums=verify_checksums)
    try:
        skeleton = json.loads((directory / SKELETON).read_bytes())
        tensors = {name: torch.empty(spec.shape, dtype=spec.dtype) for name, spec in manifest.tensors.items()}
        if tensors:
            dcp.load(tensors, storage_reader=SafeFileSystemReader(directory), no_dist=True)
    except CheckpointCorruptError:
        raise
    except (Exception, CheckpointException) as err:  # DCP raises CheckpointException, a BaseException
        raise CheckpointCorruptError(f"{directory}: shard unreadable ({type(err).__name__}: {err})") from err
    return manifest, StagedSnapshot(manifest.step, skeleton, tensors, dict(manifest.meta))


_ALLOWED_MODULES = {
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
}
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch._utils", "_get_layout"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: DCP's own dataclasses, torch dtypes, sizes and paths."""

    def find_class(self, module: str, name: str) -> Any:
        # protocol >= 4 resolves a dotted name attribute by attribute, so "os.system" would be reached through
        # an allowed module's globals; and of an allowed module only the classes it defines are needed
        if "." in name:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")
        if module in _ALLOWED_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout):
            return getattr(torch, name)
        if module == "torch" and name == "contiguous_format":
            return torch.contiguous_format
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


class SafeFileSystemReader(FileSystemReader):
    """DCP reader whose metadata load cannot execute arbitrary code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointCorruptError(f"{self.path}: DCP metadata is not a Metadata object")
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata
