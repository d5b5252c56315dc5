"""Typed, self-validating configuration dataclasses, one per component."""

from lightning_resilience.config.checkpoint import (
    CheckpointConfig,
    DeltaLocalTierConfig,
    LocalTierConfig,
    MemoryTierConfig,
    PeerTierConfig,
    RemoteTierConfig,
)
from lightning_resilience.config.ft import FaultToleranceConfig

__all__ = [
    "CheckpointConfig",
    "DeltaLocalTierConfig",
    "FaultToleranceConfig",
    "LocalTierConfig",
    "MemoryTierConfig",
    "PeerTierConfig",
    "RemoteTierConfig",
]
