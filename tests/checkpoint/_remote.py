"""What the remote tier's tests share: a tier on a URL or on the loopback S3 server with an injected ``sleep`` that
records its backoffs, a started manager, a few trained steps, the keys a step left in the bucket."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.local import step_dirname
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.remote import RemoteTier
from lightning_resilience.checkpoint.tier import Tier, TierIdentity
from tests.checkpoint._s3server import S3Endpoint
from tests.checkpoint.conftest import state_at

__all__ = ["WAIT", "Sleeps", "bound", "remote_of", "remote_tier", "s3_tier", "started", "step_keys", "train"]

WAIT = timedelta(seconds=30)
"""The bound on every wait for the manager."""


class Sleeps:
    """The injected ``sleep``: records every backoff instead of waiting."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def remote_tier(url: str, sleeps: Sleeps | None = None, **kwargs: Any) -> RemoteTier:
    kwargs.setdefault("every_n_steps", 1)
    kwargs.setdefault("keep", 2)
    tier = RemoteTier(url, sleep=sleeps or Sleeps(), **kwargs)
    if hasattr(tier.fs, "retries"):
        tier.fs.retries = 1  # s3fs retries some errors itself, sleeping for real; the tier's own loop is under test
    return tier


def s3_tier(s3: S3Endpoint, sleeps: Sleeps | None = None, *, prefix: str = "run", **kwargs: Any) -> RemoteTier:
    kwargs.setdefault("storage_options", s3.storage_options())
    return remote_tier(s3.url(prefix), sleeps, **kwargs)


def bound(tier: RemoteTier, rank: int = 0, world_size: int = 1) -> RemoteTier:
    tier.bind(TierIdentity(rank, world_size))
    return tier


def started(managers: list[CheckpointManager], tiers: list[Tier]) -> CheckpointManager:
    manager = CheckpointManager(tiers, CheckpointConfig(drain_timeout_s=WAIT.total_seconds()))
    manager.setup()
    managers.append(manager)
    return manager


def train(manager: CheckpointManager, steps: range) -> None:
    for step in steps:
        assert manager.on_step(step, state_at(step), meta={"epoch": step // 3}) is True
        assert manager.wait(WAIT) is True


def remote_of(manager: CheckpointManager) -> RemoteTier:
    (tier,) = [t for t in manager.tiers if isinstance(t, RemoteTier)]
    return tier


def step_keys(s3: S3Endpoint, step: int, prefix: str = "run") -> list[str]:
    return s3.keys(f"{prefix}/{step_dirname(step)}/")
