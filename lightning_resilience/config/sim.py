"""Re-exports: the simulator's config lives in :mod:`lightning_resilience.sim.config`."""

from lightning_resilience.sim.config import *  # noqa: F403
from lightning_resilience.sim.config import __all__ as __all__
