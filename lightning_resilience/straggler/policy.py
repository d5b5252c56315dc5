"""The action ladder: what to do about a confirmed straggler, as its slowdown persists and grows.

Each level has a slowdown threshold and a persistence requirement (training steps). While an episode lasts, a level
counts the steps whose current slowdown is at or above its threshold (a step below resets the count) and fires once
the count reaches its persistence; each level fires at most once per episode.

A level names an :class:`~lightning_resilience.policy.Action` of the suite's one vocabulary: 'log', 'alert' or
'stop' (:attr:`Action.CHECKPOINT_AND_STOP`, which the detector posts to the policy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_resilience.policy import Action
from lightning_resilience.straggler.config import StragglerLevelConfig

__all__ = ["LEVEL_ACTIONS", "ActionLadder", "Escalation", "StragglerFinding"]

LEVEL_ACTIONS = {
    "log": Action.LOG,
    "alert": Action.ALERT,
    "stop": Action.CHECKPOINT_AND_STOP,
}
"""A ladder level's ``action`` setting -> the action it stands for."""


_COMPONENTS = {
    "compute": "its own compute (forward, backward, optimizer; collective waits excluded)",
    "data": "the wait for its next batch",
    "work": "every rank's own work (compute and data wait), against the job's own history",
}


@dataclass(frozen=True)
class StragglerFinding:
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
    evidence: str = ""
    """Who waits for whom: the other ranks' collective wait per step against this rank's, when the waits are
    measured (a rank slow in its own work makes the others wait for it in the gradient all-reduce)."""

    @property
    def component(self) -> str:
        return _COMPONENTS.get(self.section, f"section '{self.section}'")

    def describe(self) -> str:
        since = f"since ~step {self.onset_step}, confirmed at step {self.step}; jitter {self.noise:.0%}"
        if self.scope == "job":
            return f"the whole job is {self.slowdown:.2f}x slower: {self.component} ({since})"
        return (
            f"rank {self.rank} (node {self.node_index}, {self.node}) is {self.slowdown:.2f}x slower in "
            f"{self.component} ({self.score} score, {since})" + (f"; {self.evidence}" if self.evidence else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Escalation:
    """One ladder level firing for one straggler at one step; every rank computes the same decisions."""

    action: Action
    verdict: StragglerFinding
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
    verdict: StragglerFinding
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
    def active(self) -> list[StragglerFinding]:
        return [e.verdict for e in self._episodes.values()]

    def start(self, verdict: StragglerFinding, previous_step: int | None = None) -> None:
        """A new episode begins at ``verdict.step``; nothing fires yet: ``observe`` counts the steps since
        ``previous_step`` (the previous sample; default: the step before)."""
        n = len(self.levels)
        last = verdict.step - 1 if previous_step is None else previous_step
        self._episodes[(verdict.rank, verdict.section)] = _Episode(verdict, last, [0] * n, [False] * n)

    def end(self, rank: int, section: str) -> None:
        self._episodes.pop((rank, section), None)

    def observe(self, rank: int, section: str, step: int, slowdown: float) -> list[Escalation]:
        """The episode of ``(rank, section)`` shows ``slowdown`` at ``step``: the levels that fire now."""
        episode = self._episodes.get((rank, section))
        if episode is None:
            return []
        elapsed = max(1, step - episode.last_step)  # with a gather cadence > 1 one sample stands for several steps
        episode.last_step = step
        episode.verdict = replace(episode.verdict, slowdown=float(slowdown))
        out: list[Escalation] = []
        for i, level in enumerate(self.levels):
            episode.counts[i] = episode.counts[i] + elapsed if slowdown >= level.slowdown else 0
            if not episode.fired[i] and episode.counts[i] >= level.persist_steps:
                episode.fired[i] = True
                action = LEVEL_ACTIONS[str(level.action)]
                out.append(Escalation(action, episode.verdict, step, level.slowdown, level.persist_steps))
        return sorted(out, key=lambda d: d.action.severity)
