"""Small deterministic configurations shared by the simulator tests."""

from __future__ import annotations

from lightning_resilience.sim.config import (
    ClusterConfig,
    FailureConfig,
    FailureKindConfig,
    JobConfig,
    RestartConfig,
    SimConfig,
    SimTierConfig,
)
from lightning_resilience.sim.step_cost import SuiteCostConfig


def kinds(**overrides: dict) -> list[FailureKindConfig]:
    """One of each kind (equal shares), with zero detection delay unless overridden."""
    base = {
        "crash": dict(fraction=0.25, node_lost=False, restart="in_job"),
        "hang": dict(fraction=0.25, restart="in_job"),
        "sdc": dict(fraction=0.25, restart="in_job"),
        "fail_slow": dict(fraction=0.25, restart="in_job", slowdown=0.5),
    }
    return [FailureKindConfig(name=n, **{**kw, **overrides.get(n, {})}) for n, kw in base.items()]


def tiny(
    tiers: list[SimTierConfig] | None = None,
    *,
    horizon: float = 100.0,
    restart: RestartConfig | None = None,
    failure_kinds: list[FailureKindConfig] | None = None,
    nodes: int = 4,
    spares: int = 0,
    target_steps: int | None = None,
) -> SimConfig:
    """1 s steps, 1-GPU nodes, costs in whole seconds, a suite that costs nothing per step: every expected figure can
    be worked out by hand."""
    return SimConfig(
        cluster=ClusterConfig(gpus=nodes, gpus_per_node=1, spare_nodes=spares, spare_refill_s=50.0),
        failures=FailureConfig(mttf_s=1e9, ref_gpus=1, kinds=failure_kinds or kinds()),
        tiers=tiers if tiers is not None else [SimTierConfig(name="disk", every_n_steps=10, restore_s=5.0)],
        restart=restart or RestartConfig(in_process=1.0, in_job=3.0, warm_spare=4.0, cold=20.0),
        job=JobConfig(step_s=1.0, horizon_s=horizon, target_steps=target_steps),
        suite=SuiteCostConfig(fixed_s=0.0, hop_s=0.0),
    )
