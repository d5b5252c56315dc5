"""How often each checkpoint tier is written: as set where the user set a cadence, chosen from measured costs where
the cost budget decides (a tier's ``every_n_steps`` left at 0, :data:`~lightning_resilience.checkpoint.tier.BUDGET`).

One function turns costs into cadences, :func:`~lightning_resilience.checkpoint.cadence_plan.plan_cadences`; the
engine's :class:`CadenceController` here measures what this run costs and feeds it, the reliability simulator feeds
it a tier's configured costs, so both choose alike.

The budget (``checkpoint.overhead_budget``, a fraction of the step time) is one for all the suite's work on the
training thread: the detectors' work on every step (the straggler detector's step ends, SDC's guards, counted as
they run) takes what it costs first, the persistent tiers that the budget decides share at most half of the rest, a
tier with a fixed cadence takes what it costs, and the RAM tiers share what is left. A cost is what the training
thread spends in the engine (snapshot copies, waits for a background copy before the optimizer step, persist
agreements) and, for a snapshot, what it slows the step after it by: its background copy shares the training
thread's cores and memory. That is measured as the run goes, the steps after a snapshot against the steps no call
touched, once a RAM tier is spaced out (every k >= 2 steps: while every step has a snapshot there is no clean step
to measure against, and the blocking alone decides). What a persist's background write takes from the steps is not
counted (it runs every hundreds of steps; the benchmarks measure it as step-time slowdown).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lightning_resilience.checkpoint.cadence_plan import Cadence, TierCosts, pct, plan_cadences
from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.intervals import estimate_mtbf
from lightning_resilience.checkpoint.tier import BUDGET, Durability, Tier

__all__ = ["BUDGET", "CadenceChange", "CadenceController"]

log = logging.getLogger(__name__)

WARMUP_STEPS = 8
"""Steps measured before the first choice (every budgeted RAM tier snapshots every step meanwhile)."""
_MIN_SAMPLES = 8  # clean steps and steps after a snapshot needed before the snapshot's effect on the next is counted
_WINDOW = 64
_OUTLIER = 3.0  # a cost sample above this many medians (a first allocation, a GC pause) is left out of the mean


# ------------------------------------------------------------------------------------------------ the controller
@dataclass(frozen=True)
class CadenceChange:
    """A cadence chosen at a step (for the log, the report and the ledger)."""

    step: int
    tier: str
    every_n_steps: int
    set_by: str
    reason: str


class _Agreement:
    """The review's one collective: a MAX over ranks of a few integers."""

    def __init__(self, reduce_max_each: Callable[..., list[int]] | None, rank: int) -> None:
        self.reduce, self.rank = reduce_max_each, rank

    def max_each(self, values: list[int], step: int) -> list[int]:
        return values if self.reduce is None else self.reduce(values, op="checkpoint.cadence", step=step)


def _robust_mean(samples: Sequence[float]) -> float | None:
    if not samples:
        return None
    median = statistics.median(samples)
    kept = [s for s in samples if s <= _OUTLIER * median] or list(samples)
    return statistics.fmean(kept)


class CadenceController:
    """Measures what checkpointing costs this run and, every ``review_steps`` steps, chooses the cadence of each tier
    left to the budget (:func:`plan_cadences`); a tier with a cadence set in its config keeps it, always.

    The manager calls :meth:`begin` at the start of each ``on_step``, :meth:`due` for each tier, :meth:`end` with
    what the call blocked, and :meth:`blocked` for each wait for a background copy. Every rank chooses the same
    cadences: a review is one all-reduce (MAX) of the measured costs on the manager's side group, at the same steps
    on every rank, and none runs when no tier is left to the budget.

    Args:
        tiers: the manager's tiers.
        budget: ``checkpoint.overhead_budget``.
        mtbf_prior_s: ``checkpoint.mtbf_prior_s``, until the run's failure history says more
            (:meth:`note_failures`).
        review_steps: steps between two choices.
        write_seconds: a persistent tier's mean write time so far, by name (None: no write yet).
        clock: monotonic seconds (the manager's).
    """

    @classmethod
    def of(
        cls,
        tiers: Sequence[Tier],
        config: CheckpointConfig,
        *,
        write_seconds: Callable[[str], float | None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> CadenceController:
        """The controller of an engine with ``config``'s budget, MTBF prior and review cadence."""
        return cls(
            tiers,
            budget=config.overhead_budget,
            mtbf_prior_s=config.mtbf_prior_s,
            review_steps=config.cadence_review_steps,
            write_seconds=write_seconds,
            clock=clock,
        )

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        budget: float,
        mtbf_prior_s: float,
        review_steps: int,
        write_seconds: Callable[[str], float | None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.budget, self.mtbf_prior_s, self.review_steps = budget, mtbf_prior_s, review_steps
        self._tiers = [(t.name, t.durability is not Durability.process, t.every_n_steps) for t in tiers]
        self._write_seconds = write_seconds
        self._clock = clock
        self.budgeted = any(every == BUDGET for _, _, every in self._tiers)
        # until the first review: RAM every step (to measure it), persistent tiers not at all (nothing measured)
        self._every: dict[str, int | None] = {
            name: every if every != BUDGET else (None if persistent else 1) for name, persistent, every in self._tiers
        }
        self.plan: dict[str, Cadence] = {}
        self.changes: list[CadenceChange] = []
        self._agreement = _Agreement(None, 0)
        self._observed_s, self._failures = 0.0, 0
        self._mtbf_s = mtbf_prior_s
        self._measured: dict[str, float] = {}
        self._steps: deque[float] = deque(maxlen=_WINDOW)
        self._clean: deque[float] = deque(maxlen=_WINDOW)  # steps after a call that took nothing
        self._after: deque[float] = deque(maxlen=_WINDOW)  # steps after a snapshot (no persist)
        self._snapshots: deque[float] = deque(maxlen=_WINDOW)
        self._persists: deque[float] = deque(maxlen=_WINDOW)
        self._last_begin: float | None = None
        self._pending: tuple[str, float] | None = None  # kind of the last call, what it blocked so far
        self._next_review: int | None = None
        self._detectors: Callable[[], float] | None = None
        self._begun = 0  # on_step calls so far
        self._detector_mark: tuple[float, int] | None = None  # detector seconds and calls at the last review

    def bind(self, reduce_max_each: Callable[..., list[int]] | None, rank: int) -> None:
        """The side group's ``reduce_max_each`` (None: a world of one) and this rank."""
        self._agreement = _Agreement(reduce_max_each, rank)

    def count_detectors(self, spent_s: Callable[[], float]) -> None:
        """The detectors' training-thread seconds so far (cumulative): taken from the budget before the tiers'."""
        self._detectors = spent_s

    def note_failures(self, observed_s: float, failures: int) -> None:
        """The run's failure history so far (its ledger: ``failures`` in ``observed_s`` of training)."""
        self._observed_s, self._failures = observed_s, failures
        self._mtbf_s = estimate_mtbf(self.mtbf_prior_s, observed_s, failures)

    @property
    def mtbf_s(self) -> float:
        return self._mtbf_s

    def every(self, name: str) -> int | None:
        """The cadence tier ``name`` follows now (None: not written until the first choice)."""
        return self._every[name]

    def due(self, tier: Tier, step: int) -> bool:
        every = self._every[tier.name]
        return every is not None and step % every == 0

    # ------------------------------------------------------------------ measuring
    def begin(self, step: int) -> None:
        """At the start of ``on_step``: close the last step's figures; at a review step, agree and choose."""
        if not self.budgeted:
            return
        self._begun += 1
        now = self._clock()
        blocked, kind = 0.0, None
        if self._pending is not None:
            kind, blocked = self._pending
            (self._snapshots if kind == "snapshot" else self._persists).append(blocked)
            self._pending = None
        if self._last_begin is not None and now > self._last_begin:
            period = max(now - self._last_begin - blocked, 0.0)
            self._steps.append(period)
            if kind is None:
                self._clean.append(period)
            elif kind == "snapshot":
                self._after.append(period)
        self._last_begin = now
        if self._next_review is None:
            self._next_review = step + min(WARMUP_STEPS, self.review_steps)
        elif step >= self._next_review:
            self._next_review = step + self.review_steps
            self._review(step)

    def end(self, blocked_s: float, *, snapshot: bool, persist: bool) -> None:
        """What ``on_step`` blocked: a snapshot only, or a persist agreement (with or without a RAM snapshot)."""
        if not self.budgeted or not (snapshot or persist):
            return
        if persist:  # what a persist adds to the snapshot taken at the same step anyway
            extra = blocked_s - ((_robust_mean(self._snapshots) or 0.0) if snapshot else 0.0)
            self._pending = ("persist", max(extra, 0.0))
        else:
            self._pending = ("snapshot", blocked_s)

    def blocked(self, seconds: float) -> None:
        """A wait for the last snapshot's background copy (billed to it)."""
        if self._pending is not None:
            self._pending = (self._pending[0], self._pending[1] + seconds)

    def background_s(self) -> float:
        """What a snapshot slows the step after it by, beyond its blocking: the median of the steps after a snapshot
        less the median of the steps no call touched (0 until there are a few of each). Medians: one slow step (a
        collection, a page fault) among the few after a snapshot must not space the snapshots out."""
        if len(self._clean) < _MIN_SAMPLES or len(self._after) < _MIN_SAMPLES:
            return 0.0
        return max(statistics.median(self._after) - statistics.median(self._clean), 0.0)

    # ------------------------------------------------------------------ choosing
    def _review(self, step: int) -> None:
        snapshot = _robust_mean(self._snapshots)
        persist = _robust_mean(self._persists)
        persistent = [name for name, p, _ in self._tiers if p]
        writes = [self._write_seconds(name) for name in persistent]
        local = [
            round(statistics.median(self._steps) * 1e6) if self._steps else 0,
            round((snapshot or 0.0) * 1e6),
            round(persist * 1e6) if persist is not None else -1,  # -1: no persist measured here
            round(self._mtbf_s) if self._agreement.rank == 0 else 0,  # rank 0 holds the run's failure history
            round(self._detector_step_s() * 1e6),
            round(self.background_s() * 1e6),
            *(round((w or 0.0) * 1e6) for w in writes),
        ]
        agreed = self._agreement.max_each(local, step)
        if agreed[0] <= 0:
            return  # no step measured yet: the next review decides
        step_s, snapshot_s = agreed[0] / 1e6, agreed[1] / 1e6
        persist_s = agreed[2] / 1e6 if agreed[2] >= 0 else None
        self._mtbf_s = float(agreed[3]) or self._mtbf_s
        detectors_s, background_s = agreed[4] / 1e6, agreed[5] / 1e6
        write = dict(zip(persistent, (w / 1e6 for w in agreed[6:])))
        self._measured = {
            "step_s": step_s, "snapshot_s": snapshot_s, "snapshot_background_s": background_s,
            "detectors_s": detectors_s,
        }  # fmt: skip
        if persist_s is not None:
            self._measured["persist_s"] = persist_s
        # a persist reads every byte of the snapshot again: never counted as cheaper than a snapshot
        persist_cost = max(persist_s or 0.0, snapshot_s)
        costs = [
            TierCosts(name, True, persist_cost, write_s=write.get(name, 0.0), every_n_steps=every)
            if p
            else TierCosts(name, False, snapshot_s, background_s=background_s, every_n_steps=every)
            for name, p, every in self._tiers
        ]
        detectors = detectors_s / step_s
        for cadence in plan_cadences(
            costs, step_s=step_s, budget=self.budget, mtbf_s=self._mtbf_s, detectors=detectors
        ):
            persistent_tier = cadence.name in persistent
            if persist_s is None and persistent_tier and cadence.set_by != "config":
                cadence = Cadence(
                    cadence.name, self.review_steps, "unmeasured",
                    f"no persist measured yet: once every {self.review_steps} steps until one is", cadence.overhead,
                )  # fmt: skip
            self._choose(step, cadence)

    def _detector_step_s(self) -> float:
        """The detectors' seconds per step since the last review (0 without detectors)."""
        if self._detectors is None:
            return 0.0
        spent, calls = self._detectors(), self._begun
        last_spent, last_calls = self._detector_mark or (0.0, 0)
        self._detector_mark = (spent, calls)
        return max(spent - last_spent, 0.0) / max(calls - last_calls, 1)

    def _choose(self, step: int, cadence: Cadence) -> None:
        previous = self.plan.get(cadence.name)
        self.plan[cadence.name] = cadence
        if cadence.set_by == "config":
            return
        self._every[cadence.name] = cadence.every_n_steps
        if previous is not None and previous.every_n_steps == cadence.every_n_steps:
            return
        self.changes.append(CadenceChange(step, cadence.name, cadence.every_n_steps, cadence.set_by, cadence.reason))
        if self._agreement.rank == 0:
            log.info("checkpoint cadence at step %d: tier %r every %d steps (%s)", step, cadence.name,
                     cadence.every_n_steps, cadence.reason)  # fmt: skip

    # ------------------------------------------------------------------ telling
    def describe(self) -> list[str]:
        """One line per tier: its cadence now and why."""
        lines = []
        for name, persistent, every in self._tiers:
            chosen = self.plan.get(name)
            if every != BUDGET:
                lines.append(f"tier {name!r}: every {every} steps (set in the config)")
            elif chosen is not None:
                lines.append(f"tier {name!r}: every {chosen.every_n_steps} steps ({chosen.reason})")
            else:
                first = "not written until" if persistent else "every step until"
                lines.append(
                    f"tier {name!r}: the {pct(self.budget)} overhead budget decides; {first} the costs are measured "
                    f"({WARMUP_STEPS} steps), with an MTBF of {self._mtbf_s / 3600:.2f} h "
                    f"({self._failures} failure(s) in {self._observed_s / 3600:.2f} h of this run and the prior)"
                )
        return lines

    def report(self) -> dict[str, Any]:
        """The budget, the MTBF, what was measured, each tier's cadence and why, and every change."""
        tiers = {}
        for name, _, every in self._tiers:
            chosen = self.plan.get(name)
            tiers[name] = {
                "every_n_steps": self._every[name],
                "set_by": "config" if every != BUDGET else (chosen.set_by if chosen else "unmeasured"),
                "reason": chosen.reason if chosen else ("set in the config" if every != BUDGET else "not chosen yet"),
                "overhead": chosen.overhead if chosen else None,
            }
        return {
            "overhead_budget": self.budget,
            "mtbf_s": self._mtbf_s,
            "mtbf_prior_s": self.mtbf_prior_s,
            "failures_seen": self._failures,
            "observed_s": self._observed_s,
            "measured": dict(self._measured),
            "tiers": tiers,
            "changes": [asdict(c) for c in self.changes],
        }
