"""The one vocabulary of the suite, and the policy that turns detectors' verdicts into one action for all ranks.

* :class:`Event` — what a detector can find (a corrupt step, a straggler, a preemption notice, a hang).
* :class:`Verdict` — one detector's finding on one rank, posted to the policy.
* :class:`Action` — what the job does, mildest first; the order is the reduction order.
* :class:`Decision` — the action every rank takes at one step, and the exit code it leads to.

Detectors post verdicts; the most severe (action, event) any rank asked for travels in the next step's one
agreement (:mod:`lightning_resilience.step`), and :meth:`PolicyBus.decide` turns the agreed value into a decision,
so every rank takes the same action on the same step and ends with the same exit code. The mapping from event to
action is the user's (:class:`PolicyConfig`); every decision is kept for the report. Nothing here imports Lightning.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from lightning_resilience._configurable import ConfigError
from lightning_resilience.exit_codes import ExitCode
from lightning_resilience.rollback.config import RollbackConfig

__all__ = [
    "ACTIONS",
    "ALLOWED",
    "Action",
    "Decision",
    "Event",
    "PolicyBus",
    "PolicyConfig",
    "Verdict",
]

ACTIONS = (
    "log",
    "alert",
    "rollback_in_process",
    "checkpoint_and_stop",
    "rollback",
    "emergency_save_and_exit",
    "dump_and_exit",
)
"""Every action, least to most severe: when several verdicts arrive together, the most severe one is taken."""

ALLOWED = {
    "sdc_mismatch": ("log", "alert", "rollback_in_process", "checkpoint_and_stop", "rollback"),
    "straggler": ("log", "alert", "checkpoint_and_stop"),
    "preemption": ("log", "emergency_save_and_exit"),
    "hang": ("log", "dump_and_exit"),
    "nonfinite": ("log", "alert", "rollback_in_process", "checkpoint_and_stop", "rollback"),
    "spike": ("log", "alert", "rollback_in_process"),
}
"""The actions that make sense for each event (a hang cannot be rolled back: the stuck rank cannot take part)."""


@dataclass(kw_only=True)
class PolicyConfig:
    """What the job does when a detector reports something; every rank takes the same action at the same step."""

    sdc_mismatch: str = "rollback"
    """A confirmed silent-data-corruption mismatch caught after the optimizer step: 'rollback' (stop, and restart
    from the newest checkpoint verified clean), 'checkpoint_and_stop', 'alert' or 'log'. Caught before the
    optimizer step it is recomputed in place whatever this says. Whatever it says, a corrupt state ends the process
    with ``ExitCode.SDC`` and the next attempt restores at most the verified step."""
    straggler: str = "checkpoint_and_stop"
    """A confirmed straggler at the top of the detector's ladder: 'checkpoint_and_stop' (the launcher restarts
    without the slow node), 'alert' or 'log'."""
    preemption: str = "emergency_save_and_exit"
    """A preemption signal: 'emergency_save_and_exit' (save the newest snapshot, exit with the requeue code) or
    'log' (ignore it and let the scheduler kill the job)."""
    hang: str = "dump_and_exit"
    """A hung rank: 'dump_and_exit' (stack dumps, exit code, the launcher restarts the group) or 'log' (dump only)."""
    nonfinite: str = "rollback_in_process"
    """A non-finite loss or gradient (SDC's guards, read late: the update is applied): 'rollback_in_process'
    (restore the newest RAM snapshot before the bad step in the running process, skip its batch, go on; see
    ``rollback``), 'rollback' (stop, restart from the newest verified checkpoint), 'checkpoint_and_stop', 'alert' or
    'log'."""
    spike: str = "log"
    """A loss or gradient-norm spike against the guards' robust baseline: 'rollback_in_process', 'alert' or
    'log'."""
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    """How an in-process rollback goes: steps back, skipping the batch, learning-rate cool-down, the cap per window
    after which the job stops."""
    exit_after_fit: bool = True
    """When the job was stopped (or its state found corrupt), end the process with the decided exit code at the
    end of ``fit`` (``DecidedExit``, a ``SystemExit``, raised after every callback's teardown), so a launcher sees
    it without a line of user code. False: ``fit`` returns and the caller ends the process with
    ``Suite.of(trainer).exit_code``."""
    timeout_s: float = 300.0
    """Bound on each agreement between ranks: the step's agreement (issued at a step's start, taken at its end), the
    restore bound at resume, an in-process rollback."""
    agreement_fanout: int = 4
    """Children per rank in the tree the step's agreement runs along: each rank talks to at most this many + 1 peers,
    and a round takes 2 x log_fanout(ranks) hops."""

    def __post_init__(self) -> None:
        for event, allowed in ALLOWED.items():
            value = getattr(self, event)
            if value not in allowed:
                raise ConfigError("policy", event, f"must be one of {list(allowed)}, got {value!r}")
        if not self.timeout_s > 0:
            raise ConfigError("policy", "timeout_s", f"must be > 0, got {self.timeout_s}")
        if self.agreement_fanout < 2:
            raise ConfigError("policy", "agreement_fanout", f"must be >= 2, got {self.agreement_fanout}")

    def action_for(self, event: str) -> str:
        if event not in ALLOWED:
            raise ValueError(f"unknown resilience event {event!r}; known: {list(ALLOWED)}")
        return str(getattr(self, event))

    def mapping(self) -> dict[str, str]:
        return {event: self.action_for(event) for event in ALLOWED}


class Event(str, Enum):
    """What a detector found."""

    SDC_MISMATCH = "sdc_mismatch"
    STRAGGLER = "straggler"
    PREEMPTION = "preemption"
    HANG = "hang"
    NONFINITE = "nonfinite"
    SPIKE = "spike"

    @property
    def exit_code(self) -> ExitCode:
        """The code a stop for this event ends the process with."""
        return _EXIT_CODES[self]


_EXIT_CODES = {
    Event.SDC_MISMATCH: ExitCode.SDC,
    Event.STRAGGLER: ExitCode.STRAGGLER,
    Event.PREEMPTION: ExitCode.PREEMPTED,
    Event.HANG: ExitCode.HANG,
    Event.NONFINITE: ExitCode.SDC,
    Event.SPIKE: ExitCode.DIVERGED,
}
_EVENTS = list(Event)


class Action(str, Enum):
    """What the job does, least to most severe (the order is the reduction order)."""

    LOG = "log"
    ALERT = "alert"
    ROLLBACK_IN_PROCESS = "rollback_in_process"
    CHECKPOINT_AND_STOP = "checkpoint_and_stop"
    ROLLBACK = "rollback"
    EMERGENCY_SAVE_AND_EXIT = "emergency_save_and_exit"
    DUMP_AND_EXIT = "dump_and_exit"

    @property
    def severity(self) -> int:
        return ACTIONS.index(self.value)

    @property
    def stops(self) -> bool:
        """Whether the job stops (and the process ends with a non-zero code) after this action."""
        return self.severity >= Action.CHECKPOINT_AND_STOP.severity


@dataclass(frozen=True)
class Verdict:
    """One detector's finding on one rank."""

    event: Event
    step: int
    rank: int
    detail: str
    source: str = ""
    """The detector that posted it ('straggler', 'sdc', 'fault_tolerance')."""
    verified_step: int | None = None
    """For a corrupt state: the newest committed step verified clean; a restart restores at most this step."""
    bad_step: int | None = None
    """The first step whose update is suspect (its batch is the offender): the state ``bad_step`` is the newest one
    an in-process rollback may restore. None: not known (the detection step is used)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "event": self.event.value,
            "step": self.step,
            "rank": self.rank,
            "detail": self.detail,
            "source": self.source,
            "verified_step": self.verified_step,
            "bad_step": self.bad_step,
        }


@dataclass
class Decision:
    """The action every rank takes at ``step`` for ``event``, and the verdicts (this rank's) that led to it."""

    step: int
    action: Action
    event: Event
    verdicts: list[Verdict] = field(default_factory=list)
    code: ExitCode | None = None
    """The exit code when it is not the event's (an escalation: in-process rollbacks past their cap)."""

    @property
    def exit_code(self) -> ExitCode:
        """The process's exit code after this decision: the event's code when the job stops, else OK."""
        if not self.action.stops:
            return ExitCode.OK
        return self.code if self.code is not None else self.event.exit_code

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "action": self.action.value,
            "event": self.event.value,
            "exit_code": int(self.exit_code),
            "verdicts": [v.to_json() for v in self.verdicts],
        }


class PolicyBus:
    """Collects verdicts on one rank and turns them into the decisions every rank takes alike.

    A verdict posted on one rank reaches the others through the next step's agreement: :meth:`contribute` gives the
    most severe (action, event) posted since the last round as one integer, the ranks reduce it (MAX), and
    :meth:`decide` turns the agreed integer into a decision. A verdict every rank posts alike (computed from
    gathered data, or from agreed values) is posted with ``agreed=True`` and needs no round. Nothing here waits for
    another rank.

    Args:
        config: the event -> action mapping.
    """

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self._pending: list[tuple[Verdict, int]] = []  # verdict, the severity it asks for
        self._inflight: list[tuple[Verdict, int]] = []  # contributed to the round in flight
        self._agreed: list[tuple[Verdict, int]] = []  # posted alike on every rank: decided at the next decide()
        self._lock = threading.Lock()  # detectors may post from their own threads (the watchdog)
        self.decisions: list[Decision] = []

    def action_for(self, event: Event) -> Action:
        return Action(self.config.action_for(event.value))

    def post(self, verdict: Verdict, *, at_least: Action | None = None, agreed: bool = False) -> Action:
        """Record a verdict; returns the action it leads to: the mapping's action for its event, raised to
        ``at_least`` when that is more severe. ``agreed``: every rank posts the same verdict at the same step."""
        action = self.action_for(verdict.event)
        if at_least is not None and at_least.severity > action.severity:
            action = at_least
        with self._lock:
            (self._agreed if agreed else self._pending).append((verdict, action.severity))
        return action

    @staticmethod
    def _encode(posted: list[tuple[Verdict, int]]) -> int:
        return max((severity * len(_EVENTS) + _EVENTS.index(v.event) for v, severity in posted), default=-1)

    def contribute(self) -> int:
        """This rank's field of the next round: its most severe verdict since the last round (-1: none)."""
        with self._lock:
            self._inflight += self._pending
            self._pending = []
            return self._encode(self._inflight)

    def decide(self, step: int, agreed: int) -> Decision | None:
        """The decision of ``step`` from the round's agreed field and the verdicts posted alike on every rank
        (None: nothing to do). Ties between events of the same severity go to the later event in :class:`Event`."""
        with self._lock:
            mine, self._inflight = self._inflight, []
            alike, self._agreed = self._agreed, []
        value = max(agreed, self._encode(alike))
        if value < 0:
            return None
        severity, event_index = divmod(value, len(_EVENTS))
        decision = Decision(step, Action(ACTIONS[severity]), _EVENTS[event_index], [v for v, _ in [*mine, *alike]])
        self.decisions.append(decision)
        return decision

    def report(self) -> dict[str, Any]:
        return {"mapping": dict(self.config.mapping()), "decisions": [d.to_json() for d in self.decisions]}
