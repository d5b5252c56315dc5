"""Guard values read late, and their part of each step's agreement.

With a read lag (``sdc.guard_read_lag``, 1 by default) a step's guard values reach the host a step or more later,
without stalling the device. At the start of each step the values that arrived are checked here
(:meth:`LateGuards.read`); what they say goes into the step's one agreement as six integers (a guard fired, a
parameter norm jumped, a value was not finite, a job-wide guard fired: OR; the first non-finite step and the first
spiking step: MIN), and every rank reads the agreed findings at the step's end (:meth:`LateGuards.agreed`). A loop
without a step driver agrees on them at once in one all-reduce (:meth:`LateGuards.agree_now`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_resilience.collective import SideGroup
from lightning_resilience.sdc.guards import GuardReader, GuardReport, Guards
from lightning_resilience.step.agreement import Op
from lightning_resilience.step.driver import Field

__all__ = ["RANK_GUARDS", "LateFindings", "LateGuards", "count_fired"]

RANK_GUARDS = ("loss_spike", "nonfinite_loss")
"""Guards on what one rank computed alone (its batch's loss): when only these fire, the ranks that saw them are the
ones whose batches a replay checks. The others (the gradient norm, taken after the all-reduce) speak for the job."""
_NONE = 2**62  # no step (the identity of MIN)
_FIELDS = (
    Field("sdc.guard_fired", Op.OR),
    Field("sdc.param_jump", Op.OR),
    Field("sdc.nonfinite", Op.OR),
    Field("sdc.first_nonfinite_step", Op.MIN),
    Field("sdc.first_spike_step", Op.MIN),
    Field("sdc.job_guard_fired", Op.OR),
)


def count_fired(counts: dict[str, int], report: GuardReport) -> None:
    """Count each guard that fired in ``report``."""
    for name in report.fired:
        counts[name] = counts.get(name, 0) + 1


@dataclass(frozen=True)
class LateFindings:
    """What every rank's late guards said, agreed (the same on every rank)."""

    fired: bool = False
    """A loss or gradient guard fired on some rank: replay the next step."""
    jumped: bool = False
    """A parameter norm jumped on some rank: reconcile the replicas."""
    nonfinite: bool = False
    nonfinite_step: int | None = None
    """The earliest step whose update was not finite on some rank (the newest state not touched by it)."""
    spike_step: int | None = None
    """The earliest step whose loss or gradient norm spiked on some rank."""
    reports: list[GuardReport] = field(default_factory=list)
    """This rank's reports that fired, read for this round."""
    job_wide: bool = False
    """A guard that is not one rank's own (:data:`RANK_GUARDS`) fired on some rank: replay every rank's batch."""


class LateGuards:
    """Reads the late guard values of one rank and encodes them for the step's agreement.

    Args:
        guards: the baselines (reports that ask for nothing are accepted into them at once).
        reader: where staged guard values arrive.
        counts: guard name -> times fired (the monitor's statistics).
    """

    def __init__(self, guards: Guards, reader: GuardReader, counts: dict[str, int]) -> None:
        self.guards, self.reader, self.counts = guards, reader, counts
        self._reports: dict[int, list[GuardReport]] = {}

    def fields(self) -> list[Field]:
        return list(_FIELDS)

    def read(self, step: int) -> list[int]:
        """Check the guard values that reached the host (no device read, no wait); this rank's six values."""
        fired = jumped = nonfinite = job = False
        reports: list[GuardReport] = []
        quiet: list[GuardReport] = []  # spikes a replay found genuine a moment ago: a verdict, no new replay
        for report in self.reader.arrived():
            if not report.fired:  # the common case: nothing to say, the values join the baselines
                self.guards.accept(report)
                continue
            count_fired(self.counts, report)
            step_guards = report.asks_replay()
            if report.replayed:  # the replay matched: a spike is genuine, but a non-finite update is applied
                step_guards = [f for f in step_guards if f.startswith("nonfinite")]
            if step_guards:
                reports.append(report)
                fired = True
                nonfinite = nonfinite or any(f.startswith("nonfinite") for f in step_guards)
                job = job or any(f not in RANK_GUARDS for f in step_guards)
            elif report.quiet:
                quiet.append(report)
            jumped = jumped or report.asks_reconciliation()
            if not step_guards:  # a parameter-norm jump is settled by the reconciliation it forces, not here
                self.guards.accept(report)
        self._reports[step] = reports
        nonfinite_at = [r.step for r in reports if any(f.startswith("nonfinite") for f in r.fired)]
        spike_at = [r.step for r in reports + quiet if any(f.endswith("_spike") for f in r.fired)]
        first_nonfinite, first_spike = min(nonfinite_at, default=_NONE), min(spike_at, default=_NONE)
        return [int(fired), int(jumped), int(nonfinite), first_nonfinite, first_spike, int(job)]

    def agreed(self, step: int, values: Sequence[int]) -> LateFindings:
        """The findings every rank agreed for the round of ``step``."""
        reports = self._reports.pop(step, [])
        self._reports.clear()  # a round never taken (an interrupted step) is forgotten with it
        fired, jumped, nonfinite, nonfinite_at, spike_at, job = (int(v) for v in values)
        return LateFindings(
            bool(fired),
            bool(jumped),
            bool(nonfinite),
            nonfinite_at if nonfinite_at != _NONE else None,
            spike_at if spike_at != _NONE else None,
            reports,
            job_wide=bool(job),
        )

    def agree_now(self, group: SideGroup, step: int, values: list[int]) -> list[int]:
        """Without a step driver: the agreed values now, in one all-reduce (OR of flags is their MAX; MIN is the
        negated MAX of the negated values)."""
        if not group.distributed:
            return values
        signs = [-1 if f.op is Op.MIN else 1 for f in self.fields()]  # the flags are OR, the steps MIN
        agreed = group.reduce_max_each([s * v for s, v in zip(signs, values)], op="sdc.late_guards", step=step)
        return [s * v for s, v in zip(signs, agreed)]

    def clear(self) -> None:
        self._reports = {}
