"""Strategy subclasses whose checkpoint save/load go through the resilience engine."""

from lightning_resilience.lightning.strategies.ddp import ResilientDDPStrategy

__all__ = ["ResilientDDPStrategy"]
