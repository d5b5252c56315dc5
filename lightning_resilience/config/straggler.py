"""Re-exports: the straggler detector's config lives in :mod:`lightning_resilience.straggler.config`."""

from lightning_resilience.straggler.config import StragglerConfig, StragglerLevelConfig

__all__ = ["StragglerConfig", "StragglerLevelConfig"]
