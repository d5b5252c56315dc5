"""Strategy subclasses whose checkpoint save/load go through the resilience engine."""

from lightning_resilience.lightning.strategies.ddp import ResilientDDPStrategy
from lightning_resilience.lightning.strategies.model_parallel import ResilientModelParallelStrategy

__all__ = ["ResilientDDPStrategy", "ResilientModelParallelStrategy"]
