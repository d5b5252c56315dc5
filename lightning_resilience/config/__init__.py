"""Hydra schema registration of the component configs, and their public names.

Each component owns its config dataclass (``LocalTier.Config``, :class:`~lightning_resilience.straggler.config.
StragglerConfig`...); this package imports them (downwards only) and registers them with Hydra
(:func:`register_configs`). The names below are the public ones and stay importable from here.
"""

from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.config.checkpoint import (
    DeltaLocalTierConfig,
    LocalTierConfig,
    MemoryTierConfig,
    PeerTierConfig,
    RemoteTierConfig,
)
from lightning_resilience.config.registry import register_configs
from lightning_resilience.ft.config import FaultToleranceConfig
from lightning_resilience.policy import PolicyConfig
from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.straggler.config import StragglerConfig, StragglerLevelConfig

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
