"""The storage tier protocol: every place a checkpoint can live implements these few methods."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from lightning_resilience._configurable import ConfigError
from lightning_resilience.checkpoint.snapshot import StagedSnapshot

__all__ = ["Tier", "TierIdentity", "check_cadence"]


class TierIdentity:
    """Where this process sits in the job; a tier stores and lists the shard of its own rank only."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")
        self.rank = rank
        self.world_size = world_size


@runtime_checkable
class Tier(Protocol):
    """A place that holds committed checkpoints of this rank.

    Attributes:
        name: short unique label used in logs, metrics and the report (``memory``, ``local``, ``s3``...).
        every_n_steps: how often a snapshot is sent to this tier.
        keep: how many committed steps this tier retains.
        durability: higher survives more (0 = process memory, 1 = node-local disk, 2 = off-node storage).
    """

    name: str
    every_n_steps: int
    keep: int
    durability: int

    def bind(self, identity: TierIdentity) -> None:
        """Called once before use with this process's rank and the world size."""

    def write(self, snap: StagedSnapshot) -> None:
        """Commit ``snap`` atomically: after a crash at any instant the step is either fully there or absent."""

    def read(self, step: int) -> StagedSnapshot:
        """Return the validated snapshot of ``step``; the caller owns its tensors.

        Raises:
            CheckpointCorruptError: the step is missing, partial or fails validation.
        """

    def list_steps(self) -> list[int]:
        """Committed steps of this rank, oldest first (cheap: validation happens in :meth:`read`)."""

    def delete(self, step: int) -> None:
        """Remove a committed step; a reader never sees it half-deleted."""


def check_cadence(owner: str, every_n_steps: int, keep: int) -> None:
    """A tier's cadence and retention, checked by its config (``owner`` is ``tiers.<name>``)."""
    if every_n_steps < 1:
        raise ConfigError(owner, "every_n_steps", f"must be >= 1, got {every_n_steps}")
    if keep < 1:
        raise ConfigError(owner, "keep", f"must be >= 1, got {keep}")
