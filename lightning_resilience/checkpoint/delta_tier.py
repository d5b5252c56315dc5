"""DeltaLocalTier: a node-local tier that stores most steps as deltas against its newest full step.

A full shard every ``full_every`` writes and, in between, delta shards against the newest full shard of the same
tier (one level, never a chain of deltas). A delta shard is committed with the same protocol as a full one (private
temp directory, every file fsynced, manifest last, atomic rename) and holds::

    <root>/step_000000000123/rank_00000/{delta.json, delta.bin, skeleton.json, manifest.json}

``manifest.json`` is the ordinary shard manifest (tensor specs, per-file size and checksum) with
``meta["delta_of"] = <base step>``. Full shards are plain ``LocalTier`` shards. The encoding is
:mod:`lightning_resilience.checkpoint.delta`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zstandard

from lightning_resilience._configurable import ConfigError
from lightning_resilience.checkpoint.delta import MAX_LOSSY_BITS, decode_delta, encode_delta
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.format import (
    MANIFEST,
    SKELETON,
    check_identity,
    checksum_file,
    read_manifest,
    seal_shard,
    shard_bytes,
    validate_shard,
    write_synced,
)
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tier import TierIdentity, Written
from lightning_resilience.checkpoint.tree import TensorSpec
from lightning_resilience.collective import Deadline

__all__ = ["DELTA_OF", "DeltaLocalTier"]

log = logging.getLogger(__name__)

DELTA_OF = "delta_of"
"""Key of a delta shard's manifest ``meta`` naming the step of the full shard it was made against (reserved)."""
DELTA_JSON = "delta.json"
DELTA_BIN = "delta.bin"


@dataclass
class _Base:
    """The full shard deltas are currently made against."""

    step: int
    manifest_digest: str
    tensors: dict[str, torch.Tensor] | None  # None: read back from disk when needed (cache_base=False)


class DeltaLocalTier(LocalTier):
    """A :class:`LocalTier` that stores most steps as compressed deltas against the tier's newest full step.

    Every ``full_every``-th write is a plain full shard; the writes in between are deltas against that full shard
    (never against another delta, so one lost delta costs one step). A delta is read by loading and validating its
    base and decoding; a missing, corrupt or rewritten base raises :class:`CheckpointCorruptError` naming both
    steps, so a restore falls back to an older step. Deleting a full step that retained deltas still depend on is
    deferred until the last of them is deleted: with ``keep=K`` the disk holds the newest ``K`` steps plus at most
    the full steps they depend on.

    The first write after :meth:`bind` (a new process) is always full. Decisions are per rank: ranks write full
    shards at the same steps as long as their writes succeed alike, and a restore takes a step only if every
    rank's shard (full or delta) of it is loadable.

    Takes a :class:`DeltaLocalTier.Config`, or its fields as arguments:
    ``DeltaLocalTier("/nvme/ckpt", every_n_steps=20, full_every=10)``.
    """

    @dataclass(kw_only=True)
    class Config(LocalTier.Config):
        """Node-local disk tier storing most steps as XOR+zstd deltas against its newest full step."""

        full_every: int = 10
        """A full shard every this many writes; deltas against it in between (1: always full)."""
        level: int = 3
        """zstd level of delta shards (1-22), single-threaded."""
        lossy_bits: int = 0
        """0 = lossless. k > 0 drops the lowest k mantissa bits of float32 deltas (relative error < 2**(k-23)) and
        breaks bitwise resume."""
        cache_base: bool = True
        """Hold the current base in host RAM (one training state) instead of re-reading it for every delta."""

        def __post_init__(self) -> None:
            super().__post_init__()
            owner = f"tiers.{self.name}"
            if self.full_every < 1:
                raise ConfigError(owner, "full_every", f"must be >= 1, got {self.full_every}")
            if not 1 <= self.level <= zstandard.MAX_COMPRESSION_LEVEL:
                raise ConfigError(
                    owner, "level", f"must be in [1, {zstandard.MAX_COMPRESSION_LEVEL}], got {self.level}"
                )
            if not 0 <= self.lossy_bits <= MAX_LOSSY_BITS:
                raise ConfigError(owner, "lossy_bits", f"must be in [0, {MAX_LOSSY_BITS}], got {self.lossy_bits}")

        def build(self) -> DeltaLocalTier:
            return DeltaLocalTier(self)

    def __init__(self, *args: Any, **settings: Any) -> None:
        super().__init__(*args, **settings)
        config = self.config
        assert isinstance(config, DeltaLocalTier.Config)
        self.full_every = config.full_every
        self.level = config.level
        self.lossy_bits = config.lossy_bits
        self.cache_base = config.cache_base
        self._base: _Base | None = None
        self._deltas_since_full = 0
        self._deferred_deletes: set[int] = set()
        self.last_write_bytes = 0
        """Bytes on disk of the shard committed by the newest successful :meth:`write` (manifest included)."""
        self.last_write_base: int | None = None
        """The base step of that shard, None when it was written full."""

    def __repr__(self) -> str:
        return (
            f"DeltaLocalTier({str(self.root)!r}, every_n_steps={self.every_n_steps}, keep={self.keep}, "
            f"full_every={self.full_every})"
        )

    def bind(self, identity: TierIdentity) -> None:
        super().bind(identity)
        self._base = None  # another rank's shards, or a new process: start with a full write
        self._deltas_since_full = 0
        self._deferred_deletes.clear()

    # ---------------------------------------------------------------------------------------------- write
    def write(self, snap: StagedSnapshot, deadline: Deadline | None = None) -> Written:
        if deadline is not None:
            deadline.check(f"tier {self.name!r}: write of step {snap.step}")
        if DELTA_OF in snap.meta:
            raise ValueError(f"checkpoint meta key {DELTA_OF!r} is reserved by DeltaLocalTier; rename it")
        base = self._usable_base(snap.step)
        base_tensors = None
        if base is not None and self._deltas_since_full < self.full_every - 1:
            try:
                base_tensors = self._base_tensors(base)
            except CheckpointCorruptError as err:  # only with cache_base=False: the base went bad on disk
                log.warning(
                    "tier %r: base step %d unreadable (%s); writing step %d full", self.name, base.step, err, snap.step
                )
        if base is None or base_tensors is None:
            self._write_full(snap)
            self.last_write_base = None
        else:
            self._write_delta(snap, base, base_tensors)
            self._deltas_since_full += 1
            self.last_write_base = base.step
        self.last_write_bytes = shard_bytes(self.shard_dir(snap.step))
        return Written(snap.step, self.last_write_bytes, self.last_write_base)

    def _write_full(self, snap: StagedSnapshot) -> None:
        super().write(snap)
        self._deferred_deletes.discard(snap.step)
        digest = checksum_file(self.shard_dir(snap.step) / MANIFEST)
        old, self._base = self._base, None
        tensors = self._copy_base(snap.tensors, old.tensors if old else None) if self.cache_base else None
        self._base = _Base(snap.step, digest, tensors)
        self._deltas_since_full = 0

    @staticmethod
    def _copy_base(tensors: dict[str, torch.Tensor], reuse: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Our own copy of a new base (the snapshot's buffers are reused for later steps), written into the old
        base's buffers where the spec matches: no fresh allocation (and page faults) every full write."""
        out = {}
        for name, tensor in tensors.items():
            buf = reuse.get(name) if reuse is not None else None
            if buf is not None and buf.shape == tensor.shape and buf.dtype == tensor.dtype:
                out[name] = buf.copy_(tensor)
            else:
                out[name] = tensor.detach().clone(memory_format=torch.contiguous_format)
        return out

    def _usable_base(self, step: int) -> _Base | None:
        """The current base if a delta of ``step`` may be made against it: older, still committed, not rewritten."""
        base = self._base
        if base is None or base.step >= step:
            return None
        try:
            if checksum_file(self.shard_dir(base.step) / MANIFEST) != base.manifest_digest:
                return None
        except OSError:
            return None
        return base

    def _base_tensors(self, base: _Base) -> dict[str, torch.Tensor]:
        if base.tensors is not None:
            return base.tensors
        return super().read(base.step).tensors

    def _write_delta(self, snap: StagedSnapshot, base: _Base, base_tensors: dict[str, torch.Tensor]) -> None:
        blobs, meta = encode_delta(base_tensors, snap.tensors, level=self.level, lossy_bits=self.lossy_bits)
        offset = 0
        for name, entry in meta["tensors"].items():
            entry["offset"] = offset
            offset += len(blobs[name])
        doc = {**meta, "base_step": base.step, "base_manifest_xxh3_64": base.manifest_digest}

        def fill(tmp: Path) -> None:
            tmp.mkdir(parents=False, exist_ok=False)
            with open(tmp / DELTA_BIN, "wb") as f:
                for name in meta["tensors"]:
                    f.write(blobs[name])
                f.flush()
                os.fsync(f.fileno())
            write_synced(tmp / DELTA_JSON, json.dumps(doc, separators=(",", ":")).encode())
            seal_shard(
                tmp,
                snap,
                meta={**snap.meta, DELTA_OF: base.step},
                rank=self._identity.rank,
                world_size=self._identity.world_size,
                rank_layout=self.rank_layout,
                versions={"zstandard": zstandard.__version__},
            )

        self._commit(snap.step, fill)
        self._deferred_deletes.discard(snap.step)

    # ----------------------------------------------------------------------------------------------- read
    def read(self, step: int) -> StagedSnapshot:
        shard = self.shard_dir(step)
        if not shard.is_dir():
            raise CheckpointCorruptError(f"{shard}: not committed")
        if DELTA_OF not in read_manifest(shard).meta:
            return super().read(step)
        return self._read_delta(step, shard)

    def _read_delta(self, step: int, shard: Path) -> StagedSnapshot:
        manifest = validate_shard(shard, verify_checksums=self.verify_checksums)
        check_identity(
            manifest, step=step, rank=self._identity.rank, world_size=self._identity.world_size, where=str(shard)
        )
        missing = {DELTA_JSON, DELTA_BIN} - set(manifest.files)
        if missing:
            raise CheckpointCorruptError(f"{shard}: delta shard's manifest lists no {sorted(missing)}")
        try:
            doc = json.loads((shard / DELTA_JSON).read_bytes())
            skeleton = json.loads((shard / SKELETON).read_bytes())
            base_step = int(manifest.meta[DELTA_OF])
            if int(doc["base_step"]) != base_step or base_step >= step:
                raise ValueError(f"base step {doc['base_step']} (manifest says {base_step}) for step {step}")
            payload = memoryview((shard / DELTA_BIN).read_bytes())
            blobs = {
                name: payload[int(entry["offset"]) : int(entry["offset"]) + int(entry["size"])]
                for name, entry in doc["tensors"].items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointCorruptError(f"{shard}: delta shard unreadable ({type(err).__name__}: {err})") from err
        base = self._read_base(step, shard, base_step, str(doc.get("base_manifest_xxh3_64")))
        try:
            tensors = decode_delta(base, blobs, doc)
        except CheckpointCorruptError as err:
            raise CheckpointCorruptError(f"{shard}: delta step {step} against full step {base_step}: {err}") from err
        specs = {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in tensors.items()}
        if specs != manifest.tensors:
            raise CheckpointCorruptError(f"{shard}: decoded tensors differ from the manifest's tensor specs")
        meta = {k: v for k, v in manifest.meta.items() if k != DELTA_OF}
        return StagedSnapshot(step, skeleton, tensors, meta)

    def _read_base(self, step: int, shard: Path, base_step: int, digest: str) -> dict[str, torch.Tensor]:
        base_shard = self.shard_dir(base_step)
        try:
            if not base_shard.is_dir():
                raise CheckpointCorruptError(f"{base_shard}: not committed (deleted?)")
            if DELTA_OF in read_manifest(base_shard).meta:
                raise CheckpointCorruptError(f"{base_shard}: is itself a delta")
            if checksum_file(base_shard / MANIFEST) != digest:
                raise CheckpointCorruptError(f"{base_shard}: rewritten after the delta was made")
            return super().read(base_step).tensors
        except (CheckpointCorruptError, OSError) as err:
            raise CheckpointCorruptError(
                f"{shard}: delta step {step} cannot be restored because its base, full step {base_step}, is missing "
                f"or invalid ({err}); an older step must be used"
            ) from err

    # --------------------------------------------------------------------------------------------- delete
    def base_of(self, step: int) -> int | None:
        """The full step a committed delta ``step`` depends on; None for a full step or an unreadable manifest."""
        try:
            value = read_manifest(self.shard_dir(step)).meta.get(DELTA_OF)
            return None if value is None else int(value)
        except (CheckpointCorruptError, TypeError, ValueError):
            return None  # a delta whose manifest cannot be read can never be restored: it depends on nothing

    def dependants(self, step: int) -> list[int]:
        """Committed deltas of this rank made against full step ``step``, oldest first."""
        return [s for s in self.list_steps() if s > step and self.base_of(s) == step]

    def delete(self, step: int) -> None:
        """Delete ``step``; a full step that retained deltas depend on is deleted after the last of them."""
        dependants = self.dependants(step)
        if dependants:
            if step not in self._deferred_deletes:
                log.info(
                    "tier %r: keeping full step %d until deltas %s that need it are deleted",
                    self.name,
                    step,
                    dependants,
                )
            self._deferred_deletes.add(step)
            return
        base = self.base_of(step)
        super().delete(step)
        self._deferred_deletes.discard(step)
        if base is not None and base in self._deferred_deletes and not self.dependants(base):
            self.delete(base)
