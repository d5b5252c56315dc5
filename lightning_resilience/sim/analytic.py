"""Closed-form checkpoint-interval models: Young's first-order optimum and Daly's higher-order one.

Notation (seconds): ``delta`` the time a checkpoint costs the job, ``mttf`` the job's mean time between (exponential)
failures, ``restart`` the time from a failure until work resumes. ``interval`` is the compute time between two
checkpoints, checkpoint cost excluded. The two intervals live with the engine's cadence choice
(:mod:`lightning_resilience.checkpoint.cadence_plan`), which both the engine and the simulator use.
"""

from __future__ import annotations

import math

from lightning_resilience.checkpoint.intervals import check_delta_mttf, daly_interval, young_interval

__all__ = ["daly_ettr", "daly_interval", "first_order_waste", "young_interval"]


def daly_ettr(interval: float, delta: float, mttf: float, restart: float) -> float:
    """Useful fraction of wall time under Daly's complete model with exponential failures.

    Expected wall time for work ``W``: ``M * exp(R/M) * (exp((tau + delta)/M) - 1) * W / tau``; failures may strike
    during checkpoints and restarts alike, and each one rolls back to the last completed checkpoint.
    """
    check_delta_mttf(delta, mttf)
    if interval <= 0:
        raise ValueError(f"interval must be > 0, got {interval!r}")
    wall_per_work = mttf * math.exp(restart / mttf) * math.expm1((interval + delta) / mttf) / interval
    return 1.0 / wall_per_work


def first_order_waste(interval: float, delta: float, mttf: float, restart: float) -> float:
    """First-order fraction of wall time wasted: ``delta/tau + (tau/2 + R)/M``."""
    check_delta_mttf(delta, mttf)
    if interval <= 0:
        raise ValueError(f"interval must be > 0, got {interval!r}")
    return delta / interval + (interval / 2.0 + restart) / mttf
