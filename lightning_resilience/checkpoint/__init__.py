"""Tiered checkpoint engine: host snapshots, tiers, on-disk format, background persist and collective restore."""

from lightning_resilience.checkpoint.dataloader import ResumableDataLoader
from lightning_resilience.checkpoint.delta_tier import DeltaLocalTier
from lightning_resilience.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWorkerError,
    NoValidCheckpointError,
)
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.manager import CheckpointManager, CheckpointStats, Restored
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.remote import RemoteTier, RemoteTierError
from lightning_resilience.checkpoint.replication import PeerTier
from lightning_resilience.checkpoint.reshard import ReshardError, plan_reshard, restore_resharded
from lightning_resilience.checkpoint.tier import CollectiveTier, Durability, RamTier, Tier, Written

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointStats",
    "CheckpointWorkerError",
    "CollectiveTier",
    "DeltaLocalTier",
    "Durability",
    "LocalTier",
    "MemoryTier",
    "NoValidCheckpointError",
    "PeerTier",
    "RamTier",
    "RemoteTier",
    "RemoteTierError",
    "ReshardError",
    "ResumableDataLoader",
    "Restored",
    "Tier",
    "Written",
    "plan_reshard",
    "restore_resharded",
]
