"""Young/Daly closed forms, and the simulator against Daly in the regime where his model holds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_resilience.sim import (
    daly_ettr,
    daly_interval,
    first_order_waste,
    optimal_interval,
    simulate,
    with_interval,
    young_interval,
)
from lightning_resilience.sim.config import (
    ClusterConfig,
    FailureConfig,
    FailureKindConfig,
    JobConfig,
    RestartConfig,
    SimConfig,
    SimTierConfig,
)

M, DELTA, R = 3600.0, 60.0, 300.0


def test_young_and_daly_values() -> None:
    assert young_interval(60.0, 3600.0) == pytest.approx(math.sqrt(2 * 60 * 3600))
    x = 60.0 / 7200.0
    assert daly_interval(60.0, 3600.0) == pytest.approx(math.sqrt(2 * 60 * 3600) * (1 + math.sqrt(x) / 3 + x / 9) - 60)
    assert daly_interval(10.0, 4.0) == 4.0  # delta >= 2M: checkpoint every MTTF
    # Daly's ETTR peaks at (about) his interval
    grid = np.linspace(300, 1200, 901)
    best = grid[np.argmax([daly_ettr(t, DELTA, M, R) for t in grid])]
    assert best == pytest.approx(daly_interval(DELTA, M), rel=0.02)
    assert first_order_waste(600.0, 60.0, 3600.0, 300.0) == pytest.approx(0.1 + 600 / 7200 + 300 / 3600)
    with pytest.raises(ValueError, match="mttf"):
        young_interval(1.0, 0.0)


def _daly_regime(interval: float, seed: int = 0, horizon_mttfs: float = 4000.0) -> SimConfig:
    """Daly's assumptions: exponential failures, a synchronous checkpoint that survives everything, no detection
    delay, restart R (which failures can interrupt), lost work = time since the last completed checkpoint."""
    return SimConfig(
        cluster=ClusterConfig(gpus=8, gpus_per_node=8),
        failures=FailureConfig(
            mttf_s=M, ref_gpus=8, kinds=[FailureKindConfig(name="crash", fraction=1.0, restart="in_job")]
        ),
        tiers=[SimTierConfig(name="ckpt", every_s=interval, blocking_s=DELTA, durability="remote")],
        restart=RestartConfig(in_job=R),
        job=JobConfig(step_s=1.0, horizon_s=M * horizon_mttfs, seed=seed),
    )


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_simulated_ettr_matches_dalys_complete_model(factor: float) -> None:
    interval = factor * daly_interval(DELTA, M)
    r = simulate(_daly_regime(interval))
    # ~4000 failures: the standard error of the ETTR is a few tenths of a point
    assert r.ettr == pytest.approx(daly_ettr(round(interval), DELTA, M, R), abs=0.01)


def test_simulated_optimum_interval_is_within_10_percent_of_daly() -> None:
    daly = daly_interval(DELTA, M)  # ~618 s (Young: ~657 s)
    opt, rows = optimal_interval(
        _daly_regime(daly, horizon_mttfs=2500.0), candidates_s=list(daly * np.geomspace(0.4, 2.5, 9)), replications=2
    )
    assert opt == pytest.approx(daly, rel=0.10), rows
    # and the curve really has an interior maximum
    ettr = [r["ettr_mean"] for r in rows]
    assert max(ettr) > ettr[0] and max(ettr) > ettr[-1]


def test_with_interval_replaces_the_cadence_of_one_tier() -> None:
    cfg = _daly_regime(600.0)
    changed = with_interval(cfg, 120.0, "ckpt")
    assert changed.tiers[0].every_s == 120.0 and cfg.tiers[0].every_s == 600.0
    with pytest.raises(ValueError, match="no tier named"):
        with_interval(cfg, 10.0, "missing")
