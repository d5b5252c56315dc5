"""One callback per module."""

from lightning_resilience.lightning.callbacks.fault_tolerance import HANG_EXIT_CODE, PREEMPT_EXIT_CODE, FaultTolerance
from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint

__all__ = ["HANG_EXIT_CODE", "PREEMPT_EXIT_CODE", "FaultTolerance", "TieredCheckpoint"]
