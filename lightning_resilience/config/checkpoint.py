"""Re-exports: the checkpoint engine's config lives in :mod:`lightning_resilience.checkpoint.config`, each tier's in
its own class (``LocalTier.Config``...)."""

from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.delta_tier import DeltaLocalTier
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.remote import RemoteTier
from lightning_resilience.checkpoint.replication import PeerTier

MemoryTierConfig = MemoryTier.Config
LocalTierConfig = LocalTier.Config
DeltaLocalTierConfig = DeltaLocalTier.Config
PeerTierConfig = PeerTier.Config
RemoteTierConfig = RemoteTier.Config

__all__ = [
    "CheckpointConfig",
    "DeltaLocalTierConfig",
    "LocalTierConfig",
    "MemoryTierConfig",
    "PeerTierConfig",
    "RemoteTierConfig",
]
