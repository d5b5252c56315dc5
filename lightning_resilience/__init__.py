"""lightning_resilience: make Lightning training survive the failures of large clusters."""

from lightning_resilience._version import __version__
from lightning_resilience.checkpoint import (
    CheckpointCorruptError,
    CheckpointManager,
    DeltaLocalTier,
    LocalTier,
    MemoryTier,
    NoValidCheckpointError,
    PeerTier,
    RemoteTier,
    ResumableDataLoader,
    Tier,
)
from lightning_resilience.config import (
    CheckpointConfig,
    DeltaLocalTierConfig,
    FaultToleranceConfig,
    LocalTierConfig,
    MemoryTierConfig,
    PeerTierConfig,
    RemoteTierConfig,
)
from lightning_resilience.lightning import (
    HANG_EXIT_CODE,
    PREEMPT_EXIT_CODE,
    FaultTolerance,
    ResilientDDPStrategy,
    ResilientModelParallelStrategy,
    TieredCheckpoint,
)

__all__ = [
    "HANG_EXIT_CODE",
    "PREEMPT_EXIT_CODE",
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointManager",
    "DeltaLocalTier",
    "DeltaLocalTierConfig",
    "FaultTolerance",
    "FaultToleranceConfig",
    "LocalTier",
    "LocalTierConfig",
    "MemoryTier",
    "MemoryTierConfig",
    "NoValidCheckpointError",
    "PeerTier",
    "PeerTierConfig",
    "RemoteTier",
    "RemoteTierConfig",
    "ResilientDDPStrategy",
    "ResilientModelParallelStrategy",
    "ResumableDataLoader",
    "Tier",
    "TieredCheckpoint",
    "__version__",
]
