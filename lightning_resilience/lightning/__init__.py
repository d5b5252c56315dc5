"""Thin Lightning adapters over the framework-free engines."""

from lightning_resilience.lightning.callbacks import (
    BitFlipInjection,
    FaultTolerance,
    ResiliencePolicy,
    ResilienceReportCallback,
    SDCVerification,
    StragglerDetection,
    TieredCheckpoint,
)
from lightning_resilience.lightning.coordination import Suite
from lightning_resilience.lightning.strategies.ddp import ResilientDDPStrategy
from lightning_resilience.lightning.strategies.model_parallel import ResilientModelParallelStrategy

__all__ = [
    "BitFlipInjection",
    "FaultTolerance",
    "ResilienceReportCallback",
    "ResiliencePolicy",
    "ResilientDDPStrategy",
    "ResilientModelParallelStrategy",
    "SDCVerification",
    "StragglerDetection",
    "Suite",
    "TieredCheckpoint",
]
