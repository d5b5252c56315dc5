"""The cadence function: what each checkpoint tier's cadence is, from what its checkpoints cost, the step time, the
cost budget and the job's mean time between failures.

The engine's :class:`~lightning_resilience.checkpoint.cadence.CadenceController` calls it with what the run
measured, the reliability simulator with a tier's configured costs, so both choose alike.

* A RAM tier (a snapshot, nothing written): every step while a snapshot costs at most its share of the budget,
  otherwise every k steps, the smallest k that fits. A snapshot costs its blocking and what it slows the step after
  it by.
* A persistent tier: Daly's interval from the blocking cost of a persist and the job's mean time between failures,
  never shorter than one write (a persist waits for the one before it) nor than its share of the budget allows.

The budget (a fraction of the step time) is one for all the suite's work on the training thread: the detectors'
work on every step takes what it costs first, the persistent tiers that the budget decides share at most half of
the rest, a tier with a fixed cadence takes what it costs, and the RAM tiers share what is left.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_resilience.checkpoint.intervals import check_delta_mttf, daly_interval
from lightning_resilience.checkpoint.tier import BUDGET

__all__ = ["PERSIST_SHARE", "RAM_FLOOR_SHARE", "Cadence", "TierCosts", "pct", "plan_cadences"]

PERSIST_SHARE = 0.5
"""Part of the budget the persistent tiers it decides may take together."""
RAM_FLOOR_SHARE = 0.05
"""Part of the budget the RAM tiers keep when fixed tiers take all of it (so that their cadence stays finite)."""


@dataclass(frozen=True)
class TierCosts:
    """What one checkpoint of a tier costs, and its cadence if fixed."""

    name: str
    persistent: bool
    """Written somewhere (disk, peers, a bucket); False for a RAM tier, which holds the snapshot itself."""
    blocking_s: float
    """Seconds the training thread spends per checkpoint of this tier."""
    write_s: float = 0.0
    """Background seconds from the snapshot until the write is committed (persistent tiers)."""
    every_n_steps: int = BUDGET
    """The cadence set in the config, or :data:`BUDGET` (0): chosen here."""
    background_s: float = 0.0
    """Seconds a checkpoint of this tier slows the next step by, beyond its blocking (its background copy shares the
    training thread's cores and memory)."""


@dataclass(frozen=True)
class Cadence:
    """A tier's cadence and why."""

    name: str
    every_n_steps: int
    set_by: str
    """``config`` (as set), ``budget`` (its share of the budget), ``daly`` (Daly's interval) or ``write`` (one write
    at a time)."""
    reason: str
    overhead: float
    """Expected cost per step (blocking, and a snapshot's effect on the next step) as a fraction of the step time."""


def _steps_for(cost_s: float, share: float, step_s: float) -> int:
    """The smallest k with ``cost_s / k <= share * step_s``."""
    if cost_s <= 0:
        return 1
    return max(1, math.ceil(cost_s / (share * step_s) - 1e-9))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.0f} s"


def pct(fraction: float) -> str:
    """A fraction as a percentage with two decimals (``0.0185`` -> ``1.85%``)."""
    return f"{fraction * 100:.2f}%"


def plan_cadences(
    tiers: Sequence[TierCosts], *, step_s: float, budget: float, mtbf_s: float, detectors: float = 0.0
) -> list[Cadence]:
    """The cadence of every tier, in the order given (see the module docstring for the rules).

    Args:
        tiers: each tier's costs and its fixed cadence, or :data:`BUDGET`.
        step_s: seconds of one training step, checkpointing excluded.
        budget: the blocking the training thread may spend in the suite's work, a fraction of ``step_s``.
        mtbf_s: the job's mean time between failures.
        detectors: what the detectors take per step, a fraction of ``step_s`` (taken from the budget first).
    """
    if not (step_s > 0 and math.isfinite(step_s)):
        raise ValueError(f"step_s must be a finite number > 0, got {step_s!r}")
    if not 0 < budget < 1:
        raise ValueError(f"budget must be in (0, 1), got {budget!r}")
    if not (detectors >= 0 and math.isfinite(detectors)):
        raise ValueError(f"detectors must be a finite fraction >= 0, got {detectors!r}")
    check_delta_mttf(0.0, mtbf_s)
    floor = budget * RAM_FLOOR_SHARE
    budget = max(budget - detectors, floor)  # what the checkpoint tiers may take
    chosen: dict[str, Cadence] = {}
    for t in tiers:
        if t.every_n_steps != BUDGET:
            overhead = t.blocking_s / (t.every_n_steps * step_s)
            chosen[t.name] = Cadence(
                t.name, t.every_n_steps, "config", f"set in the config: {pct(overhead)} of the step time", overhead
            )
    persist = [t for t in tiers if t.persistent and t.every_n_steps == BUDGET]
    for t in persist:
        chosen[t.name] = _persist_cadence(t, step_s, budget * PERSIST_SHARE / len(persist), mtbf_s)
    ram = [t for t in tiers if not t.persistent and t.every_n_steps == BUDGET]
    taken = sum(c.overhead for c in chosen.values())
    left = max(budget - taken, floor)
    for t in ram:
        share = left / len(ram)
        k = _steps_for(t.blocking_s + t.background_s, share, step_s)
        cost = (t.blocking_s + t.background_s) / step_s
        what = f"a snapshot blocks {_ms(t.blocking_s)}"
        if t.background_s > 0:
            what += f" and slows the next step by {_ms(t.background_s)}"
        if k == 1:
            reason = f"{what}, {pct(cost)} of a {_ms(step_s)} step: within its {pct(share)} of the budget, every step"
        else:
            reason = (
                f"{what}, {pct(cost)} of a {_ms(step_s)} step: over its {pct(share)} of the budget, so every {k} "
                f"steps ({pct(cost / k)})"
            )
        if taken > 0:
            reason += f"; the other tiers take {pct(taken)}"
        if detectors > 0:
            reason += f"; the detectors take {pct(detectors)}"
        chosen[t.name] = Cadence(t.name, k, "budget", reason, cost / k)
    return [chosen[t.name] for t in tiers]


def _persist_cadence(t: TierCosts, step_s: float, share: float, mtbf_s: float) -> Cadence:
    interval = daly_interval(t.blocking_s, mtbf_s)
    bounds = {
        "daly": max(1, round(interval / step_s)),
        "write": max(1, math.ceil(t.write_s / step_s - 1e-9)),
        "budget": _steps_for(t.blocking_s, share, step_s),
    }
    set_by = max(bounds, key=lambda name: bounds[name])  # the first of a tie: Daly's interval wins it
    k = bounds[set_by]
    why = {
        "daly": f"Daly's interval for a {_ms(t.blocking_s)} persist and a {mtbf_s / 3600:.2f} h MTBF is "
        f"{_ms(interval)} of training",
        "write": f"a write takes {_ms(t.write_s)} and the next persist waits for it",
        "budget": f"a persist blocks {_ms(t.blocking_s)}: its {pct(share)} of the budget allows no more",
    }[set_by]
    overhead = t.blocking_s / (k * step_s)
    reason = f"{why}: every {k} steps of {_ms(step_s)} ({pct(overhead)} of the step time)"
    return Cadence(t.name, k, set_by, reason, overhead)
