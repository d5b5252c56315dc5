"""Closed-form checkpoint-interval models: Young's first-order optimum and Daly's higher-order one.

Notation (seconds): ``delta`` the time a checkpoint costs the job, ``mttf`` the job's mean time between (exponential)
failures, ``restart`` the time from a failure until work resumes. ``interval`` is the compute time between two
checkpoints, checkpoint cost excluded.
"""

from __future__ import annotations

import math

__all__ = ["daly_ettr", "daly_interval", "first_order_waste", "young_interval"]


def _check(delta: float, mttf: float) -> None:
    if delta < 0 or not math.isfinite(delta):
        raise ValueError(f"delta must be a finite number >= 0, got {delta!r}")
    if mttf <= 0 or not math.isfinite(mttf):
        raise ValueError(f"mttf must be a finite number > 0, got {mttf!r}")


def young_interval(delta: float, mttf: float) -> float:
    """Young (1974): ``sqrt(2 * delta * mttf)``."""
    _check(delta, mttf)
    return math.sqrt(2.0 * delta * mttf)


def daly_interval(delta: float, mttf: float) -> float:
    """Daly (2006) higher-order optimum.

    ``sqrt(2 delta M) * (1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9) - delta`` for ``delta < 2M``, else ``M``.
    """
    _check(delta, mttf)
    if delta >= 2.0 * mttf:
        return mttf
    x = delta / (2.0 * mttf)
    return math.sqrt(2.0 * delta * mttf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def daly_ettr(interval: float, delta: float, mttf: float, restart: float) -> float:
    """Useful fraction of wall time under Daly's complete model with exponential failures.

    Expected wall time for work ``W``: ``M * exp(R/M) * (exp((tau + delta)/M) - 1) * W / tau``; failures may strike
    during checkpoints and restarts alike, and each one rolls back to the last completed checkpoint.
    """
    _check(delta, mttf)
    if interval <= 0:
        raise ValueError(f"interval must be > 0, got {interval!r}")
    wall_per_work = mttf * math.exp(restart / mttf) * math.expm1((interval + delta) / mttf) / interval
    return 1.0 / wall_per_work


def first_order_waste(interval: float, delta: float, mttf: float, restart: float) -> float:
    """First-order fraction of wall time wasted: ``delta/tau + (tau/2 + R)/M``."""
    _check(delta, mttf)
    if interval <= 0:
        raise ValueError(f"interval must be > 0, got {interval!r}")
    return delta / interval + (interval / 2.0 + restart) / mttf
