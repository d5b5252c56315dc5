"""The simulator's config dataclasses reject bad values at construction, naming the key."""

from __future__ import annotations

import pytest

from lightning_resilience.sim.config import (
    ClusterConfig,
    FailureConfig,
    FailureKindConfig,
    JobConfig,
    RestartConfig,
    SimConfig,
    SimTierConfig,
)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ClusterConfig(gpus=0), "cluster.gpus must be"),
        (lambda: ClusterConfig(spare_nodes=-1), "cluster.spare_nodes must be"),
        (lambda: FailureConfig(mttf_s=0.0), "failures.mttf_s must be"),
        (lambda: FailureConfig(weibull_shape=-1.0), "failures.weibull_shape must be"),
        (lambda: FailureConfig(kinds=[FailureKindConfig(name="crash", fraction=0.5)]), "sum to 1"),
        (lambda: FailureConfig(kinds=[]), "at least one"),
        (lambda: FailureKindConfig(name="meteor", fraction=1.0), "failures.kinds.name must be one of"),
        (lambda: FailureKindConfig(name="hang", fraction=1.0, restart="warm_spare"), "failures.hang.restart"),
        (lambda: FailureKindConfig(name="crash", fraction=1.0, slowdown=0.2), "failures.crash.slowdown"),
        (lambda: FailureKindConfig(name="sdc", fraction=1.0, detection_s=-5.0), "failures.sdc.detection_s"),
        (lambda: SimTierConfig(name="a"), "tiers.a: set exactly one"),
        (lambda: SimTierConfig(name="a", every_n_steps=1, every_s=2.0), "tiers.a: set exactly one"),
        (lambda: SimTierConfig(name="a", every_n_steps=-1), "tiers.a.every_n_steps"),
        (lambda: SimTierConfig(name="a", every_s=5.0, durability="tape"), "tiers.a.durability"),  # type: ignore[arg-type]
        (lambda: SimTierConfig(name="a", every_s=5.0, restore_s=float("nan")), "tiers.a.restore_s"),
        (lambda: RestartConfig(cold=-1.0), "restart.cold"),
        (lambda: JobConfig(step_s=0.0), "job.step_s"),
        (lambda: JobConfig(target_steps=0), "job.target_steps"),
        (
            lambda: SimConfig(tiers=[SimTierConfig(name="a", every_s=1.0), SimTierConfig(name="a", every_s=2.0)]),
            "distinct names",
        ),
    ],
)
def test_bad_values_name_the_key(build, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        build()


def test_derived_figures() -> None:
    assert ClusterConfig(gpus=10_000, gpus_per_node=8).nodes == 1250
    assert ClusterConfig(gpus=10, gpus_per_node=8).nodes == 2
    f = FailureConfig(mttf_s=7.9 * 3600, ref_gpus=1024)
    assert f.job_mttf_s(10_000) == pytest.approx(7.9 * 3600 * 1024 / 10_000)
    assert f.node_mttf_s(8) == pytest.approx(7.9 * 3600 * 128)
    assert SimTierConfig(name="a", every_s=10.0).interval_steps(3.0) == 3
    assert SimTierConfig(name="a", every_s=0.1).interval_steps(3.0) == 1
