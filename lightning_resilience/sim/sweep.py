"""Sweeps over checkpoint cadence and job scale, and the simulated optimum interval."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from lightning_resilience.sim.analytic import daly_interval, young_interval
from lightning_resilience.sim.config import SimConfig, SimTierConfig
from lightning_resilience.sim.engine import MonteCarloResult, simulate

__all__ = ["optimal_interval", "sweep", "with_gpus", "with_interval"]


def _tier_index(cfg: SimConfig, tier: str | None) -> int:
    if not cfg.tiers:
        raise ValueError("the configuration has no checkpoint tier whose interval could be swept")
    if tier is None:
        return 0
    names = [t.name for t in cfg.tiers]
    if tier not in names:
        raise ValueError(f"no tier named {tier!r}; tiers are {names}")
    return names.index(tier)


def with_interval(cfg: SimConfig, interval_s: float, tier: str | None = None) -> SimConfig:
    """A copy of ``cfg`` whose tier ``tier`` (default: the first) checkpoints every ``interval_s`` of training."""
    idx = _tier_index(cfg, tier)
    tiers = list(cfg.tiers)
    tiers[idx] = dataclasses.replace(tiers[idx], every_s=float(interval_s), every_n_steps=None)
    return dataclasses.replace(cfg, tiers=tiers)


def with_gpus(cfg: SimConfig, gpus: int) -> SimConfig:
    """A copy of ``cfg`` on ``gpus`` accelerators (same failure reference, so the job MTTF scales as 1/N)."""
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, gpus=int(gpus)))


def _tier_delta(t: SimTierConfig) -> float:
    return t.blocking_s


def _run(cfg: SimConfig, replications: int) -> MonteCarloResult:
    # common random numbers: every point of a sweep sees the same failure draws for the same replication
    return MonteCarloResult([simulate(cfg, seed=cfg.job.seed + r) for r in range(replications)])


def sweep(
    cfg: SimConfig,
    *,
    intervals_s: Sequence[float] | None = None,
    gpus: Sequence[int] | None = None,
    tier: str | None = None,
    replications: int = 3,
) -> list[dict[str, Any]]:
    """ETTR over the grid ``gpus x intervals_s`` (either may be omitted: the config's own value is used).

    Each row holds the scale, the swept tier's interval (seconds of training), the mean ETTR and its standard error
    over ``replications`` runs (common random numbers across the grid), the mean breakdown shares, the mean failure
    count, and the Young and Daly intervals for that scale computed from the swept tier's blocking cost.
    """
    if replications < 1:
        raise ValueError(f"replications must be >= 1, got {replications}")
    idx = _tier_index(cfg, tier)
    rows: list[dict[str, Any]] = []
    for n in gpus if gpus else [cfg.cluster.gpus]:
        scaled = with_gpus(cfg, n)
        mttf = scaled.failures.job_mttf_s(n)
        delta = _tier_delta(scaled.tiers[idx])
        for interval in intervals_s if intervals_s else [None]:
            point = scaled if interval is None else with_interval(scaled, interval, scaled.tiers[idx].name)
            mc = _run(point, replications)
            step = point.cadences()[idx].every_n_steps * point.job.step_s
            rows.append(
                {
                    "gpus": n,
                    "tier": point.tiers[idx].name,
                    "interval_s": step,
                    "ettr_mean": mc.ettr_mean,
                    "ettr_stderr": mc.ettr_stderr,
                    "failures_mean": mc.report()["failures_mean"],
                    "job_mttf_s": mttf,
                    "young_interval_s": young_interval(delta, mttf) if delta > 0 else None,
                    "daly_interval_s": daly_interval(delta, mttf) if delta > 0 else None,
                    "breakdown_fraction": mc.breakdown_fractions(),
                }
            )
    return rows


def optimal_interval(
    cfg: SimConfig,
    *,
    candidates_s: Sequence[float],
    tier: str | None = None,
    replications: int = 3,
) -> tuple[float, list[dict[str, Any]]]:
    """The interval of ``tier`` that maximises the simulated ETTR, refined by a parabola through the best points.

    The ETTR curve is flat near its optimum, so the arg-max of noisy points wanders; a least-squares parabola in
    log(interval) through the best point and its neighbours (up to two each side) gives a stable estimate.

    Returns:
        The estimated optimum (seconds of training between checkpoints) and the sweep rows it came from.
    """
    if len(candidates_s) < 3:
        raise ValueError(f"optimal_interval needs at least 3 candidates, got {len(candidates_s)}")
    grid = sorted(float(c) for c in candidates_s)
    rows = sweep(cfg, intervals_s=grid, tier=tier, replications=replications)
    ettr = np.array([r["ettr_mean"] for r in rows])
    best = int(np.argmax(ettr))
    lo, hi = max(0, best - 2), min(len(grid), best + 3)
    if hi - lo < 3:
        return grid[best], rows
    x = np.log(np.array([r["interval_s"] for r in rows[lo:hi]]))
    a, b, _c = np.polyfit(x, ettr[lo:hi], 2)
    if a >= 0:  # no maximum in the window: keep the grid point
        return grid[best], rows
    x_opt = float(np.clip(-b / (2 * a), x.min(), x.max()))
    return math.exp(x_opt), rows
