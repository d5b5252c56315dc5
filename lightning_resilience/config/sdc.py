"""Re-exports: the SDC verification config lives in :mod:`lightning_resilience.sdc.config`."""

from lightning_resilience.sdc.config import SDCConfig

__all__ = ["SDCConfig"]
