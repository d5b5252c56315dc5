"""One callback per module."""

from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint

__all__ = ["TieredCheckpoint"]
