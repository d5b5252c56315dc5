"""LocalTier: checkpoints in a node-local directory, committed by an atomic rename.

One directory per step, one shard directory per rank (:mod:`lightning_resilience.checkpoint.layout`); a shard is
written into a private ``.rank_NNNNN.tmp-<id>`` directory and renamed into place.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from lightning_resilience._configurable import ConfigError, config_from_args
from lightning_resilience.checkpoint.certify import TOMBSTONE, tombstone
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.format import (
    check_identity,
    fsync_dir,
    read_shard,
    shard_bytes,
    write_shard,
    write_synced,
)
from lightning_resilience.checkpoint.layout import (
    is_leftover_of,
    leftover_name,
    rank_dirname,
    step_dirname,
    step_dirs,
)
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tier import Durability, TierIdentity, Written, check_cadence
from lightning_resilience.collective import Deadline

__all__ = ["LocalTier", "step_dirname"]  # step_dirname: its old home, kept importable

log = logging.getLogger(__name__)
T = TypeVar("T")


class LocalTier:
    """Node-local directory tier (NVMe, local SSD, or any POSIX path).

    Takes a :class:`LocalTier.Config`, or its fields as arguments: ``LocalTier("/nvme/ckpt", every_n_steps=20)``.
    Each rank writes only its own shard directories below ``path`` (created if missing); older steps are deleted
    only after a newer one is committed on every rank.
    """

    @dataclass(kw_only=True)
    class Config:
        """Node-local disk tier."""

        path: str
        """Directory on node-local storage, e.g. /nvme/ckpt/run-17."""
        every_n_steps: int = 20
        """Persist cadence in optimizer steps."""
        keep: int = 3
        """Committed steps retained."""
        name: str = "local"
        """Label in logs, metrics and the report."""
        verify_checksums: bool = True
        """Recompute checksums on read before trusting a shard."""

        def __post_init__(self) -> None:
            check_cadence(f"tiers.{self.name}", self.every_n_steps, self.keep)
            self.path = os.fspath(self.path) if self.path is not None else ""
            self._check_path()

        def _check_path(self) -> None:
            if not self.path:
                raise ConfigError(f"tiers.{self.name}", "path", "must be a directory path, got an empty string")

        def build(self) -> LocalTier:
            return LocalTier(self)

    durability = Durability.host
    collective = False
    ram = False

    def __init__(self, *args: Any, **settings: Any) -> None:
        config = config_from_args(type(self).Config, args, settings, type(self).__name__)
        self.config: LocalTier.Config = config
        self.root = Path(config.path).expanduser()
        self.name = config.name
        self.every_n_steps = config.every_n_steps
        self.keep = config.keep
        self.verify_checksums = config.verify_checksums
        self._identity = TierIdentity()

    def __repr__(self) -> str:
        return f"LocalTier({str(self.root)!r}, every_n_steps={self.every_n_steps}, keep={self.keep})"

    @property
    def _rank_name(self) -> str:
        return rank_dirname(self._identity.rank)

    def bind(self, identity: TierIdentity) -> None:
        self._identity = identity
        self._remove_stale_temporaries()

    def bind_for_reading(self, identity: TierIdentity) -> None:
        """Read ``identity``'s shards without taking the rank over: unlike :meth:`bind`, removes nothing (a tool
        that inspects a live job's directory must not sweep the temporaries it is writing)."""
        self._identity = identity

    def shard_dir(self, step: int) -> Path:
        return self.root / step_dirname(step) / self._rank_name

    @property
    def rank_layout(self) -> dict[str, int]:
        return {"rank": self._identity.rank, "world_size": self._identity.world_size}

    def write(self, snap: StagedSnapshot, deadline: Deadline | None = None) -> Written:
        if deadline is not None:
            deadline.check(f"tier {self.name!r}: write of step {snap.step}")
        self._commit(
            snap.step,
            lambda tmp: write_shard(
                tmp, snap, rank=self._identity.rank, world_size=self._identity.world_size, rank_layout=self.rank_layout
            ),
        )
        return Written(snap.step, shard_bytes(self.shard_dir(snap.step)))

    def _commit(self, step: int, fill: Callable[[Path], T], rank_name: str | None = None) -> T:
        """The commit protocol: ``fill`` writes a complete shard (manifest last) into a new private directory,
        which then replaces the step's shard by one atomic rename; on any failure nothing is committed.
        ``rank_name`` commits another rank's shard (a replica held for a peer)."""
        rank_name = rank_name or self._rank_name
        step_dir = self.root / step_dirname(step)
        step_dir.mkdir(parents=True, exist_ok=True)
        tmp = step_dir / leftover_name(rank_name, "tmp")
        final = step_dir / rank_name
        try:
            filled = fill(tmp)
            if final.exists():  # the same step written again (after a rollback): replace it whole
                self._discard(final)
            os.replace(tmp, final)
            fsync_dir(step_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return filled

    def read(self, step: int) -> StagedSnapshot:
        shard = self.shard_dir(step)
        if not shard.is_dir():
            raise CheckpointCorruptError(f"{shard}: not committed")
        manifest, snap = read_shard(shard, verify_checksums=self.verify_checksums)
        check_identity(
            manifest, step=step, rank=self._identity.rank, world_size=self._identity.world_size, where=str(shard)
        )
        return snap

    def list_steps(self) -> list[int]:
        return [step for step, path in step_dirs(self.root).items() if (path / self._rank_name).is_dir()]

    def reshard_root(self) -> Path | None:
        return self.root

    def delete(self, step: int) -> None:
        step_dir = self.root / step_dirname(step)
        shard = step_dir / self._rank_name
        if shard.exists():
            self._discard(shard)
        try:
            step_dir.rmdir()  # succeeds for the last rank out; other ranks' shards keep it alive
        except OSError:
            pass

    def reject(self, step: int, reason: str) -> None:
        step_dir = self.root / step_dirname(step)
        if step_dir.is_dir():  # every rank writes the same record: the last one written stays
            tmp = step_dir / f".{TOMBSTONE}.{self._rank_name}.tmp"
            write_synced(tmp, tombstone(step, reason))
            os.replace(tmp, step_dir / TOMBSTONE)
        self.delete(step)  # the record keeps the step directory (a later write of this step supersedes it)

    def _discard(self, shard: Path) -> None:
        # rename first: a reader never sees a committed shard with files missing
        doomed = shard.parent / leftover_name(shard.name, "del")
        os.replace(shard, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def _remove_stale_temporaries(self) -> None:
        self._remove_leftovers(self._rank_name)

    def _remove_leftovers(self, rank_name: str) -> None:
        """Private directories of shard ``rank_name`` that an earlier process left half-written or half-deleted."""
        for step_dir in step_dirs(self.root).values():
            for entry in step_dir.iterdir():
                if is_leftover_of(entry.name, rank_name):
                    log.info("removing an uncommitted checkpoint left by an earlier run: %s", entry)
                    shutil.rmtree(entry, ignore_errors=True)
