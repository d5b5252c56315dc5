"""Typed, self-validating configuration dataclasses, one per component."""

from lightning_resilience.config.checkpoint import (
    CheckpointConfig,
    DeltaLocalTierConfig,
    LocalTierConfig,
    MemoryTierConfig,
    PeerTierConfig,
    RemoteTierConfig,
)

__all__ = [
    "CheckpointConfig",
    "DeltaLocalTierConfig",
    "LocalTierConfig",
    "MemoryTierConfig",
    "PeerTierConfig",
    "RemoteTierConfig",
]
