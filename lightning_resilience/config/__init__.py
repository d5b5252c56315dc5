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
from lightning_resilience.config.policy import PolicyConfig
from lightning_resilience.config.registry import register_configs
from lightning_resilience.config.sdc import SDCConfig
from lightning_resilience.config.straggler import StragglerConfig, StragglerLevelConfig

__all__ = [
    "CheckpointConfig",
    "DeltaLocalTierConfig",
    "FaultToleranceConfig",
    "LocalTierConfig",
    "MemoryTierConfig",
    "PeerTierConfig",
    "PolicyConfig",
    "RemoteTierConfig",
    "SDCConfig",
    "StragglerConfig",
    "StragglerLevelConfig",
    "register_configs",
]
