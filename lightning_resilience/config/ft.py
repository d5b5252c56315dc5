"""Re-exports: the fault-tolerance config lives in :mod:`lightning_resilience.ft.config`."""

from lightning_resilience.ft.config import SECTIONS, FaultToleranceConfig

__all__ = ["SECTIONS", "FaultToleranceConfig"]
