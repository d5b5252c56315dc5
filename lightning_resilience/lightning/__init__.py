"""Thin Lightning adapters over the framework-free engines."""

from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint
from lightning_resilience.lightning.strategies.ddp import ResilientDDPStrategy

__all__ = ["ResilientDDPStrategy", "TieredCheckpoint"]
