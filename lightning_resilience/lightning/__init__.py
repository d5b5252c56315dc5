"""Thin Lightning adapters over the framework-free engines."""

from lightning_resilience.lightning.callbacks import (
    HANG_EXIT_CODE,
    PREEMPT_EXIT_CODE,
    STRAGGLER_EXIT_CODE,
    BitFlipInjection,
    FaultTolerance,
    ResiliencePolicy,
    ResilienceReportCallback,
    SDCVerification,
    StragglerDetection,
    TieredCheckpoint,
)
from lightning_resilience.lightning.strategies.ddp import ResilientDDPStrategy
from lightning_resilience.lightning.strategies.model_parallel import ResilientModelParallelStrategy

__all__ = [
    "BitFlipInjection",
    "HANG_EXIT_CODE",
    "PREEMPT_EXIT_CODE",
    "STRAGGLER_EXIT_CODE",
    "FaultTolerance",
    "ResilienceReportCallback",
    "ResiliencePolicy",
    "ResilientDDPStrategy",
    "ResilientModelParallelStrategy",
    "SDCVerification",
    "StragglerDetection",
    "TieredCheckpoint",
]
