"""The step path: one driver runs every component's work at a step boundary, in one written order.

At the start of optimizer step ``s`` (:meth:`StepDriver.begin_step`) every :class:`Contributor` gives its fields of
the step's one agreement (a preemption notice, SDC's late guard flags, the checkpoint engine's persist view, and the
policy's most severe verdict posted since the last round), and the driver issues it without waiting
(:class:`~lightning_resilience.step.agreement.TreeAgreement`). The forward and backward of the step hide its
latency. At the end of the step (:meth:`StepDriver.end_step`):

1. **finish** — each :class:`Finisher` closes its step-local work (timings, cadence exchanges issued or taken);
2. **agree** — the round issued at the start is taken; each contributor reads its agreed fields and may answer with
   verdicts, which are the same on every rank;
3. **decide and act** — the policy turns the agreed verdicts into one decision; an in-process rollback is carried
   out by the :class:`Actor` (the Lightning adapter), before anything is captured;
4. **snapshot** — each :class:`Snapshotter` captures the step (after an in-process rollback: the restored state,
   at its step), unless the job stops or the state is known suspect (a :class:`StateWitness` says so);
5. **stop** — a stopping decision is carried out (persist now, emergency save of the snapshot just taken, or
   nothing for a corrupt state);
6. **bookkeeping** — each :class:`Bookkeeper` records the step (ledger, heartbeats, idle timers).

A verdict posted during step ``s`` is agreed in the round of step ``s + 1`` and acted on at its end: decisions act
one step late, and no rank waits for the others on an ordinary step. A verdict every rank computed from the same
data (SDC's, from a gathered comparison) is posted ``agreed`` and acted on at the end of the step that posted it.
Nothing here imports Lightning.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

from lightning_resilience.collective import SideGroup
from lightning_resilience.policy import Action, Decision, PolicyBus, PolicyConfig, Verdict
from lightning_resilience.step.agreement import Op, Pending, TreeAgreement

__all__ = [
    "Actor",
    "Bookkeeper",
    "Contributor",
    "DriverStats",
    "Field",
    "Finisher",
    "Snapshotter",
    "StateWitness",
    "StepDriver",
]

log = logging.getLogger(__name__)

_LOCAL_TIMEOUT = timedelta(seconds=60)  # unused by a group of one process: every round is agreed at once
PHASES = ("begin", "finish", "agree", "act", "snapshot", "stop", "bookkeeping")


@dataclass(frozen=True)
class Field:
    """One integer of the step's agreement, and how it is reduced over the ranks."""

    name: str
    op: Op


class Contributor(Protocol):
    """Contributes fields to the one agreement of every step."""

    def step_fields(self) -> Sequence[Field]:
        """The fields, fixed for the fit (the same on every rank)."""
        ...

    def contribute(self, step: int) -> Sequence[int]:
        """This rank's values, one per field, at the start of optimizer step ``step``."""
        ...

    def agreed(self, step: int, values: Sequence[int]) -> Sequence[Verdict]:
        """The agreed values of the round issued at the start of ``step`` (taken at its end, every rank alike);
        returns the verdicts they lead to (the same on every rank)."""
        ...


class Finisher(Protocol):
    """Closes its step-local work first thing at the step's end."""

    def finish_step(self, step: int) -> None: ...


class Snapshotter(Protocol):
    """Captures the step's state."""

    def snapshot(self, step: int) -> None: ...


class StateWitness(Protocol):
    """Knows, the same way on every rank, whether the current state is suspect (not worth a snapshot)."""

    def state_suspect(self) -> bool: ...


class Bookkeeper(Protocol):
    """Records the step once everything else is done."""

    def after_step(self, step: int, decision: Decision | None) -> None: ...


class Actor(Protocol):
    """Carries decisions out in the training framework."""

    def rollback(self, decision: Decision) -> Decision | None:
        """Restore an earlier state in place (collective); returns the stopping decision it escalates to, or None
        when training goes on from the restored state."""
        ...

    def stop(self, decision: Decision) -> None:
        """Persist what the decision asks for (collective) and stop training."""
        ...

    def note(self, decision: Decision) -> None:
        """A decision that does not stop (log, alert): say it and record it."""
        ...


@dataclass
class DriverStats:
    """The driver's own time on the training thread, per phase (seconds summed over the steps)."""

    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    last: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    """The most recent step's time per phase."""
    recent: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=10_000))
    """(step, seconds on the training thread: its round's issue and its end) of the most recent steps."""

    def per_step_ms(self) -> dict[str, float]:
        return {k: v * 1e3 / max(self.steps, 1) for k, v in self.seconds.items()}


class StepDriver:
    """The ordered step end of one training job on one rank.

    Args:
        policy: the event -> action mapping.
        agreement: the tree the rounds run on (None: this process alone, every round agreed at once).
        clock: seconds for the phase timings (injectable).
    """

    def __init__(
        self,
        policy: PolicyConfig | None = None,
        agreement: TreeAgreement | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.bus = PolicyBus(policy or PolicyConfig())
        self.agreement = agreement or TreeAgreement(SideGroup("step", _LOCAL_TIMEOUT, local=True))
        self.stats = DriverStats()
        self._clock = clock
        self._contributors: list[Contributor] = []
        self._finishers: list[Finisher] = []
        self._snapshotters: list[Snapshotter] = []
        self._witnesses: list[StateWitness] = []
        self._bookkeepers: list[Bookkeeper] = []
        self._layout: list[tuple[Contributor, int, int]] | None = None  # contributor, first field, field count
        self._ops: list[Op] = []
        self._round: tuple[int, Pending] | None = None
        self._on_post: list[Callable[[Verdict, Action, bool], None]] = []
        self.decision: Decision | None = None
        """The decision that stopped the job (the first one that did), or None."""

    # ------------------------------------------------------------------ registration
    def add_contributor(self, component: Contributor) -> None:
        if self._layout is not None:
            raise RuntimeError("a contributor joined after the first step: components are registered before training")
        self._contributors.append(component)

    def add_finisher(self, component: Finisher) -> None:
        self._finishers.append(component)

    def add_snapshotter(self, component: Snapshotter) -> None:
        self._snapshotters.append(component)

    def add_witness(self, component: StateWitness) -> None:
        self._witnesses.append(component)

    def add_bookkeeper(self, component: Bookkeeper) -> None:
        self._bookkeepers.append(component)

    def on_post(self, listener: Callable[[Verdict, Action, bool], None]) -> None:
        """``listener(verdict, action, agreed)`` for every verdict posted (a contributor's agreed ones included)."""
        self._on_post.append(listener)

    @property
    def fields(self) -> list[str]:
        """Names of the agreement's fields, in order (the policy's first)."""
        names = ["policy.decision"]
        for component in self._contributors:
            names += [f.name for f in component.step_fields()]
        return names

    def _seal(self) -> None:
        self._ops = [Op.MAX]
        layout = []
        for component in self._contributors:
            fields = list(component.step_fields())
            layout.append((component, len(self._ops), len(fields)))
            self._ops += [f.op for f in fields]
        self._layout = layout

    # ------------------------------------------------------------------ posting
    def post(self, verdict: Verdict, *, at_least: Action | None = None, agreed: bool = False) -> Action:
        """Record a verdict; returns the action it leads to. ``agreed``: every rank posts the same verdict at the same
        step (computed from gathered data), so it is decided at this step's end; otherwise it is agreed in the next
        round and decided one step later."""
        action = self.bus.post(verdict, at_least=at_least, agreed=agreed)
        for listener in self._on_post:
            listener(verdict, action, agreed)
        return action

    # ------------------------------------------------------------------ the step
    def begin_step(self, step: int) -> None:
        """Issue the round of optimizer step ``step`` (once per step; later calls for the same step do nothing)."""
        if self._round is not None and self._round[0] == step:
            return
        start = self._clock()
        if self._layout is None:
            self._seal()
        assert self._layout is not None
        values = [self.bus.contribute()]
        for component, _, count in self._layout:
            mine = list(component.contribute(step))
            if len(mine) != count:
                raise ValueError(f"{type(component).__name__} contributed {len(mine)} values for {count} fields")
            values += mine
        if self._round is not None:  # a round whose step never ended (an epoch cut mid-step): drained in order
            self._round[1].result()
        self._round = (step, self.agreement.reduce(values, self._ops, op="step.agree", step=step))
        self._bill("begin", start)

    def end_step(self, step: int, actor: Actor) -> Decision | None:
        """The step boundary after optimizer step ``step - 1`` (``step`` steps done): the phases in order."""
        start = self._clock()
        for finisher in self._finishers:
            finisher.finish_step(step)
        now = self._bill("finish", start)
        decision = self._agree(step)
        now = self._bill("agree", now)
        replaced = False
        if decision is not None and decision.action is Action.ROLLBACK_IN_PROCESS and self.decision is None:
            escalated = actor.rollback(decision)
            # training goes on from the restored state: captured below, so that a fault that comes back at once
            # finds it in RAM; an escalation persists it (restored) or leaves it (not restored) and stops
            replaced = escalated is not None and escalated.action is not Action.ROLLBACK
            decision = escalated or decision
        now = self._bill("act", now)
        corrupt = decision is not None and decision.action is Action.ROLLBACK
        if not replaced and not corrupt and not any(w.state_suspect() for w in self._witnesses):
            for snapshotter in self._snapshotters:
                snapshotter.snapshot(step)
        now = self._bill("snapshot", now)
        if decision is not None and decision.action is not Action.ROLLBACK_IN_PROCESS:
            self._carry_out(decision, actor)
        now = self._bill("stop", now)
        for keeper in self._bookkeepers:
            keeper.after_step(step, decision)
        end = self._bill("bookkeeping", now)
        self.stats.steps += 1
        self.stats.recent.append((step, end - start + self.stats.last["begin"]))
        return decision

    def settle(self, step: int, actor: Actor) -> Decision | None:
        """Outside the step path (the end of training): agree at once on what was posted since the last round and
        carry it out. Collective: every rank calls it at the same point."""
        self.begin_step(step)
        decision = self._agree(step)
        if decision is not None:
            self._carry_out(decision, actor)
        return decision

    def _agree(self, step: int) -> Decision | None:
        if self._round is None:
            return self.bus.decide(step, -1)  # no round issued for this step (nothing could be agreed before it)
        issued, pending = self._round
        self._round = None
        values = pending.result()
        assert self._layout is not None
        for component, first, count in self._layout:
            for verdict in component.agreed(issued, values[first : first + count]):
                self.post(verdict, agreed=True)
        return self.bus.decide(step, values[0])

    def _carry_out(self, decision: Decision, actor: Actor) -> None:
        if not decision.action.stops:
            actor.note(decision)
            return
        if self.decision is not None:
            return  # already stopping: the first decision holds
        self.decision = decision
        actor.stop(decision)

    def _bill(self, phase: str, start: float) -> float:
        now = self._clock()
        self.stats.seconds[phase] += now - start
        self.stats.last[phase] = now - start
        return now

    def close(self) -> None:
        """Stop the agreement's thread (bounded); a round in flight is abandoned."""
        self._round = None
        self.agreement.close()
