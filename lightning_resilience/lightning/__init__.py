"""Thin Lightning adapters over the framework-free engines."""

from lightning_resilience.lightning.callbacks import HANG_EXIT_CODE, PREEMPT_EXIT_CODE, FaultTolerance, TieredCheckpoint
from lightning_resilience.lightning.strategies.ddp import ResilientDDPStrategy
from lightning_resilience.lightning.strategies.model_parallel import ResilientModelParallelStrategy

__all__ = [
    "HANG_EXIT_CODE",
    "PREEMPT_EXIT_CODE",
    "FaultTolerance",
    "ResilientDDPStrategy",
    "ResilientModelParallelStrategy",
    "TieredCheckpoint",
]
