"""lightning_resilience: make Lightning training survive the failures of large clusters."""

from typing import TYPE_CHECKING, Any

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
    SDCConfig,
    StragglerConfig,
    StragglerLevelConfig,
)
from lightning_resilience.exit_codes import DecidedExit, ExitCode
from lightning_resilience.lightning import (
    BitFlipInjection,
    FaultTolerance,
    ResiliencePolicy,
    ResilienceReportCallback,
    ResilientDDPStrategy,
    ResilientModelParallelStrategy,
    SDCVerification,
    StragglerDetection,
    Suite,
    TieredCheckpoint,
)
from lightning_resilience.rollback import RollbackConfig
from lightning_resilience.sdc import SilentDataCorruptionError

if TYPE_CHECKING:
    from lightning_resilience.report import ResilienceReport


def __getattr__(name: str) -> Any:
    # the report (rich, the simulator, the launcher's records) is read at the end of a run: a restarted worker does
    # not pay for its import before its first step
    if name == "ResilienceReport":
        from lightning_resilience.report import ResilienceReport

        return ResilienceReport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BitFlipInjection",
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointManager",
    "DeltaLocalTier",
    "DecidedExit",
    "DeltaLocalTierConfig",
    "ExitCode",
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
    "ResiliencePolicy",
    "ResilienceReport",
    "ResilienceReportCallback",
    "ResilientDDPStrategy",
    "ResilientModelParallelStrategy",
    "ResumableDataLoader",
    "RollbackConfig",
    "SDCConfig",
    "SDCVerification",
    "SilentDataCorruptionError",
    "StragglerConfig",
    "StragglerDetection",
    "StragglerLevelConfig",
    "Suite",
    "Tier",
    "TieredCheckpoint",
    "__version__",
]
