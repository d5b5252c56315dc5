"""Thin Lightning adapters over the framework-free engines."""

from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint
from lightning_resilience.lightning.strategies.ddp import ResilientDDPStrategy
from lightning_resilience.lightning.strategies.model_parallel import ResilientModelParallelStrategy

__all__ = ["ResilientDDPStrategy", "ResilientModelParallelStrategy", "TieredCheckpoint"]
