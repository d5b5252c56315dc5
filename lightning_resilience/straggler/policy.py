"""The action ladder: what to do about a confirmed straggler, as its slowdown persists and grows.

Each level has a slowdown threshold and a persistence requirement (training steps). While an episode lasts, a level
counts the steps whose current slowdown is at or above its threshold (a step below resets the count) and fires once
the count reaches its persistence; each level fires at most once per episode.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lightning_resilience.exit_codes import ExitCode
from lightning_resilience.straggler.config import StragglerLevelConfig

__all__ = ["STRAGGLER_EXIT_CODE", "Action", "ActionLadder", "Decision", "Verdict"]

STRAGGLER_EXIT_CODE = int(ExitCode.STRAGGLER)
"""Process exit code after a 'stop' decision (checkpointed, stopping so the launcher restarts without the slow node);
distinct from a crash (1), a signal (128+n) and a clean end (0)."""


class Action(str, enum.Enum):
    """What a ladder level does, mildest first."""

    LOG = "log"
    ALERT = "alert"
    EXCLUDE = "exclude"
    STOP = "stop"

    @property
    def severity(self) -> int:
        return _SEVERITY[self]


_SEVERITY = {Action.LOG: 0, Action.ALERT: 1, Action.EXCLUDE: 2, Action.STOP: 3}


_COMPONENTS = {
    "compute": "its own compute (forward, backward, optimizer; collective waits excluded)",
    "data": "the wait for its next batch",
    "work": "every rank's own work (compute and data wait), against the job's own history",
}


@dataclass(frozen=True)
class Verdict:
    """A confirmed straggler: which rank, where it runs, in which section, and how slow. A *job* verdict
    (``scope == "job"``, ``rank == -1``) says that every rank got slower than its own history."""

    rank: int
    node: str
    """Host name of the rank."""
    node_index: int
    """Node number: rank // LOCAL_WORLD_SIZE when known, else the order in which host names first appear."""
    section: str
    """The slow component: 'compute' (the rank's own work), 'data' (its wait for batches), 'work' (job verdicts),
    or a section the user named."""
    slowdown: float
    """Current slowdown factor (median of the last confirmation samples) against the reference."""
    score: str
    """Which series confirmed it: 'relative' (vs the other ranks) or 'individual' (vs its own best)."""
    step: int
    """Step at which the slowdown was confirmed."""
    onset_step: int
    """Estimated first slow step (the change point)."""
    noise: float = 0.0
    """The series' step-to-step jitter when confirmed (robust standard deviation, as a fraction: 0.05 = 5%)."""
    scope: str = "rank"
    """'rank' (one rank is slower than the others) or 'job' (all ranks slower than their own history)."""

    @property
    def component(self) -> str:
        return _COMPONENTS.get(self.section, f"section '{self.section}'")

    def describe(self) -> str:
        since = f"since ~step {self.onset_step}, confirmed at step {self.step}; jitter {self.noise:.0%}"
        if self.scope == "job":
            return f"the whole job is {self.slowdown:.2f}x slower: {self.component} ({since})"
        return (
            f"rank {self.rank} (node {self.node_index}, {self.node}) is {self.slowdown:.2f}x slower in "
            f"{self.component} ({self.score} score, {since})"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Decision:
    """One ladder level firing for one straggler at one step; every rank computes the same decisions."""

    action: Action
    verdict: Verdict
    step: int
    threshold: float
    persist_steps: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action.value,
            "step": self.step,
            "threshold": self.threshold,
            "persist_steps": self.persist_steps,
            "verdict": self.verdict.to_dict(),
        }


@dataclass
class _Episode:
    verdict: Verdict
    last_step: int
    counts: list[int]
    fired: list[bool]


class ActionLadder:
    """Escalation per straggler episode (a (rank, section) pair between confirmation and recovery).

    Args:
        levels: the rungs; their order does not matter, each is tested on its own.
    """

    def __init__(self, levels: Sequence[StragglerLevelConfig]) -> None:
        self.levels = list(levels)
        self._episodes: dict[tuple[int, str], _Episode] = {}

    @property
    def active(self) -> list[Verdict]:
        return [e.verdict for e in self._episodes.values()]

    def start(self, verdict: Verdict, previous_step: int | None = None) -> None:
        """A new episode begins at ``verdict.step``; nothing fires yet: ``observe`` counts the steps since
        ``previous_step`` (the previous sample; default: the step before)."""
        n = len(self.levels)
        last = verdict.step - 1 if previous_step is None else previous_step
        self._episodes[(verdict.rank, verdict.section)] = _Episode(verdict, last, [0] * n, [False] * n)

    def end(self, rank: int, section: str) -> None:
        self._episodes.pop((rank, section), None)

    def observe(self, rank: int, section: str, step: int, slowdown: float) -> list[Decision]:
        """The episode of ``(rank, section)`` shows ``slowdown`` at ``step``: the levels that fire now."""
        episode = self._episodes.get((rank, section))
        if episode is None:
            return []
        elapsed = max(1, step - episode.last_step)  # with a gather cadence > 1 one sample stands for several steps
        episode.last_step = step
        episode.verdict = Verdict(**{**episode.verdict.to_dict(), "slowdown": float(slowdown)})
        out: list[Decision] = []
        for i, level in enumerate(self.levels):
            episode.counts[i] = episode.counts[i] + elapsed if slowdown >= level.slowdown else 0
            if not episode.fired[i] and episode.counts[i] >= level.persist_steps:
                episode.fired[i] = True
                action = Action(level.action)
                out.append(Decision(action, episode.verdict, step, level.slowdown, level.persist_steps))
        return sorted(out, key=lambda d: d.action.severity)
