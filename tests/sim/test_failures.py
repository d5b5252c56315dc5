"""Failure draws: counts match the configured rates (Poisson and Weibull), scale as 1/N, kinds follow the mix."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_resilience.sim import draw_failures
from lightning_resilience.sim.config import ClusterConfig, FailureConfig, JobConfig, SimConfig


def _cfg(gpus: int, shape: float = 1.0, days: float = 90.0) -> SimConfig:
    return SimConfig(
        cluster=ClusterConfig(gpus=gpus, gpus_per_node=8),
        failures=FailureConfig(mttf_s=7.9 * 3600, ref_gpus=1024, weibull_shape=shape),
        job=JobConfig(horizon_s=days * 86400.0),
    )


def test_poisson_count_matches_the_scaled_mttf() -> None:
    cfg = _cfg(10_000)
    expected = cfg.job.horizon_s / cfg.failures.job_mttf_s(10_000)  # 90 days / (7.9 h * 1024 / 10000) ~ 2670
    counts = [len(draw_failures(cfg, np.random.default_rng(seed))) for seed in range(5)]
    # the merged process is Poisson: each count, and the mean of the 5, within 4 standard deviations
    assert all(abs(c - expected) < 4 * math.sqrt(expected) for c in counts), (counts, expected)
    assert abs(np.mean(counts) - expected) < 4 * math.sqrt(expected / 5)


def test_poisson_gaps_are_exponential() -> None:
    cfg = _cfg(10_000)
    trace = draw_failures(cfg, np.random.default_rng(1))
    gaps = np.diff(trace.times)
    mttf = cfg.failures.job_mttf_s(10_000)
    assert gaps.mean() == pytest.approx(mttf, rel=0.06)
    # exponential: standard deviation equals the mean (coefficient of variation 1)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.08)


def test_job_mttf_scales_inversely_with_size() -> None:
    small, large = _cfg(1024, days=2000), _cfg(8192, days=250)
    n_small = len(draw_failures(small, np.random.default_rng(2)))
    n_large = len(draw_failures(large, np.random.default_rng(3)))
    # 1024 GPUs: 2000 days / 7.9 h ~ 6076 failures; 8192 GPUs: 250 days / (7.9 h / 8) ~ 6076 failures
    assert small.failures.job_mttf_s(1024) == pytest.approx(7.9 * 3600)
    assert large.failures.job_mttf_s(8192) == pytest.approx(7.9 * 3600 / 8)
    for n in (n_small, n_large):
        assert abs(n - 6076) < 4 * math.sqrt(6076)


@pytest.mark.parametrize("shape", [0.7, 1.5])
def test_weibull_node_renewals_keep_the_mean(shape: float) -> None:
    # a long horizon (~40 node MTTFs) so the start-up transient of all nodes starting fresh is small
    cfg = _cfg(1024, shape=shape, days=40 * 7.9 * 1024 / 8 / 24)
    trace = draw_failures(cfg, np.random.default_rng(4))
    node_mttf = cfg.failures.node_mttf_s(8)
    per_node_gaps = np.concatenate(
        [np.diff(np.concatenate([[0.0], trace.times[trace.nodes == n]])) for n in range(cfg.cluster.nodes)]
    )
    assert per_node_gaps.mean() == pytest.approx(node_mttf, rel=0.05)
    # Weibull coefficient of variation: sqrt(G(1+2/k) / G(1+1/k)^2 - 1); > 1 for k < 1, < 1 for k > 1
    cv = math.sqrt(math.gamma(1 + 2 / shape) / math.gamma(1 + 1 / shape) ** 2 - 1)
    assert per_node_gaps.std() / per_node_gaps.mean() == pytest.approx(cv, rel=0.1)
    expected = cfg.job.horizon_s / cfg.failures.job_mttf_s(1024)
    assert len(trace) == pytest.approx(expected, rel=0.05)


def test_kinds_follow_the_mix_and_nodes_are_in_range() -> None:
    cfg = _cfg(10_000)
    trace = draw_failures(cfg, np.random.default_rng(5))
    n = len(trace)
    for kind in cfg.failures.kinds:
        share = trace.kinds.count(kind.name) / n
        sd = math.sqrt(kind.fraction * (1 - kind.fraction) / n)
        assert abs(share - kind.fraction) < 4 * sd, (kind.name, share)
    assert trace.nodes.min() >= 0 and trace.nodes.max() < cfg.cluster.nodes
    assert np.all(np.diff(trace.times) >= 0)


def test_same_seed_same_trace() -> None:
    cfg = _cfg(4096, days=10)
    a, b = draw_failures(cfg, np.random.default_rng(9)), draw_failures(cfg, np.random.default_rng(9))
    assert np.array_equal(a.times, b.times) and a.kinds == b.kinds
