"""Hydra schema registration of the component configs, and their public names.

Each component owns its config dataclass (``LocalTier.Config``, :class:`~lightning_resilience.straggler.config.
StragglerConfig`...); this package imports them (downwards only) and registers them with Hydra
(:func:`register_configs`). The names below are the public ones and stay importable from here.
"""

from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.delta_tier import DeltaLocalTier
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.remote import RemoteTier
from lightning_resilience.checkpoint.replication import PeerTier
from lightning_resilience.config.registry import register_configs
from lightning_resilience.ft.config import FaultToleranceConfig
from lightning_resilience.policy import PolicyConfig
from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.straggler.config import StragglerConfig, StragglerLevelConfig

MemoryTierConfig = MemoryTier.Config
LocalTierConfig = LocalTier.Config
DeltaLocalTierConfig = DeltaLocalTier.Config
PeerTierConfig = PeerTier.Config
RemoteTierConfig = RemoteTier.Config

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
