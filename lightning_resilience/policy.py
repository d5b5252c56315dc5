"""One policy for every detector: verdicts are posted to a bus, and the action is decided once, by all ranks.

Detectors (straggler, SDC, fault tolerance) post what they found; at the next step boundary every rank calls
:meth:`PolicyBus.decide`, which reduces the most severe action any rank asked for (one small all-reduce), so every
rank takes the same action on the same step. The mapping from event to action is the user's
(:class:`PolicyConfig`); every decision is kept for the report.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from lightning_resilience._configurable import ConfigError

__all__ = ["ACTIONS", "ALLOWED", "Action", "Decision", "Event", "PolicyBus", "PolicyConfig", "PostedVerdict"]

ACTIONS = ("log", "alert", "checkpoint_and_stop", "rollback", "emergency_save_and_exit", "dump_and_exit")
"""Every action, least to most severe: when several verdicts arrive together, the most severe one is taken."""

ALLOWED = {
    "sdc_mismatch": ("log", "alert", "checkpoint_and_stop", "rollback"),
    "straggler": ("log", "alert", "checkpoint_and_stop"),
    "preemption": ("log", "emergency_save_and_exit"),
    "hang": ("log", "dump_and_exit"),
}
"""The actions that make sense for each event (a hang cannot be rolled back: the stuck rank cannot take part)."""


@dataclass(kw_only=True)
class PolicyConfig:
    """What the job does when a detector reports something; every rank takes the same action at the same step."""

    sdc_mismatch: str = "rollback"
    """A confirmed silent-data-corruption mismatch caught after the optimizer step: 'rollback' (stop, and restart
    from the newest checkpoint verified clean), 'checkpoint_and_stop', 'alert' or 'log'. Caught before the
    optimizer step it is recomputed in place whatever this says."""
    straggler: str = "checkpoint_and_stop"
    """A confirmed straggler at the top of the detector's ladder: 'checkpoint_and_stop' (the launcher restarts
    without the slow node), 'alert' or 'log'."""
    preemption: str = "emergency_save_and_exit"
    """A preemption signal: 'emergency_save_and_exit' (save the newest snapshot, exit with the requeue code) or
    'log' (ignore it and let the scheduler kill the job)."""
    hang: str = "dump_and_exit"
    """A hung rank: 'dump_and_exit' (stack dumps, exit code, the launcher restarts the group) or 'log' (dump only)."""

    def __post_init__(self) -> None:
        for event, allowed in ALLOWED.items():
            value = getattr(self, event)
            if value not in allowed:
                raise ConfigError("policy", event, f"must be one of {list(allowed)}, got {value!r}")

    def action_for(self, event: str) -> str:
        if event not in ALLOWED:
            raise ValueError(f"unknown resilience event {event!r}; known: {list(ALLOWED)}")
        return str(getattr(self, event))

    def mapping(self) -> dict[str, str]:
        return {event: self.action_for(event) for event in ALLOWED}


class Event(str, Enum):
    SDC_MISMATCH = "sdc_mismatch"
    STRAGGLER = "straggler"
    PREEMPTION = "preemption"
    HANG = "hang"


class Action(str, Enum):
    """What the job does, least to most severe (the order is the reduction order)."""

    LOG = "log"
    ALERT = "alert"
    CHECKPOINT_AND_STOP = "checkpoint_and_stop"
    ROLLBACK = "rollback"
    EMERGENCY_SAVE_AND_EXIT = "emergency_save_and_exit"
    DUMP_AND_EXIT = "dump_and_exit"

    @property
    def severity(self) -> int:
        return ACTIONS.index(self.value)


@dataclass(frozen=True)
class PostedVerdict:
    """One detector's finding on one rank."""

    event: Event
    step: int
    rank: int
    detail: str
    source: str = ""


@dataclass
class Decision:
    """The action every rank takes at ``step``, and the verdicts (this rank's) that led to it."""

    step: int
    action: Action
    verdicts: list[PostedVerdict] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "action": self.action.value,
            "verdicts": [
                {"event": v.event.value, "step": v.step, "rank": v.rank, "detail": v.detail, "source": v.source}
                for v in self.verdicts
            ],
        }


class PolicyBus:
    """Collects verdicts on one rank and turns them into collective decisions.

    Args:
        config: the event -> action mapping.
        reduce_max: all-reduce MAX of one int over the job's ranks (identity on a single rank); it must be called
            by every rank at the same step boundary.
    """

    def __init__(self, config: PolicyConfig | None = None, reduce_max: Callable[[int], int] | None = None) -> None:
        self.config = config or PolicyConfig()
        self._reduce_max = reduce_max or (lambda value: value)
        self._pending: list[PostedVerdict] = []
        self._lock = threading.Lock()  # detectors may post from their own threads (the watchdog)
        self.decisions: list[Decision] = []

    def action_for(self, event: Event) -> Action:
        return Action(self.config.action_for(event.value))

    def post(self, verdict: PostedVerdict) -> None:
        with self._lock:
            self._pending.append(verdict)

    def decide(self, step: int) -> Decision | None:
        """Collective: the most severe action asked for on any rank since the last call (None: nothing to do)."""
        with self._lock:
            pending, self._pending = self._pending, []
        local = max((self.action_for(v.event).severity for v in pending), default=-1)
        agreed = self._reduce_max(local)
        if agreed < 0:
            return None
        decision = Decision(step, Action(ACTIONS[agreed]), pending)
        self.decisions.append(decision)
        return decision

    def report(self) -> dict[str, Any]:
        return {
            "mapping": dict(self.config.mapping()),
            "decisions": [d.to_json() for d in self.decisions],
        }
