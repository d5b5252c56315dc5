"""Checkpoint intervals from a checkpoint's cost and the mean time between failures: Young's first-order optimum,
Daly's higher-order one, and the MTBF estimate that lets a run's own failures outweigh the prior. The engine's
cadences (:mod:`~lightning_resilience.checkpoint.cadence_plan`) and the reliability simulator use the same functions."""

from __future__ import annotations

import math

__all__ = ["check_delta_mttf", "daly_interval", "estimate_mtbf", "young_interval"]


def check_delta_mttf(delta: float, mttf: float) -> None:
    """``delta`` (a checkpoint's cost) finite and >= 0, ``mttf`` finite and > 0, else ValueError."""
    if delta < 0 or not math.isfinite(delta):
        raise ValueError(f"delta must be a finite number >= 0, got {delta!r}")
    if mttf <= 0 or not math.isfinite(mttf):
        raise ValueError(f"mttf must be a finite number > 0, got {mttf!r}")


def young_interval(delta: float, mttf: float) -> float:
    """Young (1974): ``sqrt(2 * delta * mttf)`` seconds of compute between checkpoints that cost ``delta``."""
    check_delta_mttf(delta, mttf)
    return math.sqrt(2.0 * delta * mttf)


def daly_interval(delta: float, mttf: float) -> float:
    """Daly (2006) higher-order optimum.

    ``sqrt(2 delta M) * (1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9) - delta`` for ``delta < 2M``, else ``M``.
    """
    check_delta_mttf(delta, mttf)
    if delta >= 2.0 * mttf:
        return mttf
    x = delta / (2.0 * mttf)
    return math.sqrt(2.0 * delta * mttf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def estimate_mtbf(prior_s: float, observed_s: float = 0.0, failures: int = 0) -> float:
    """The job's mean time between failures: the prior counts as one failure seen over ``prior_s`` of training,
    so a run's own history (``failures`` in ``observed_s``) takes over as it grows."""
    return (prior_s + max(observed_s, 0.0)) / (1 + max(failures, 0))
