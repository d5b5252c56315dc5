"""From change points to findings: each confirmed episode becomes a verdict once its slowdown stands out of the
series' jitter (until then it is a noise-level confirmation, listed but never acted on), and the action ladder turns
a verdict that persists into decisions, which every rank carries out at the same step."""

from __future__ import annotations

import hashlib
import logging
import math
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_resilience.policy import Action
from lightning_resilience.straggler.changepoint import ChangePointEvents, RobustCusum
from lightning_resilience.straggler.config import StragglerConfig
from lightning_resilience.straggler.policy import ActionLadder, Escalation, StragglerFinding
from lightning_resilience.straggler.scoreboard import JOB

__all__ = ["EpisodeChanges", "EpisodeMark", "Episodes"]

log = logging.getLogger(__name__)


EpisodeMark = tuple[int, int, int, bytes]
"""What a copy of the episodes was last sent: the lengths of the verdicts, noise-level confirmations and decisions,
and the digest of the rest (the ladders, the stop)."""


@dataclass(frozen=True)
class EpisodeChanges:
    """What changed in an :class:`Episodes` since a :data:`EpisodeMark`: the findings and decisions added after it,
    and the rest when it changed. Its size follows the changes, never the run's history (a run's confirmations add up
    by the thousand at thousands of ranks)."""

    start: tuple[int, int, int]
    verdicts: list[StragglerFinding]
    noise_level: list[StragglerFinding]
    decisions: list[Escalation]
    rest: tuple[Any, ...] | None
    """The count of noise-level confirmations, the stop, the ladders (their active episodes); None: unchanged."""
    whole: Episodes | None = None
    """The first changes a copy receives: the episodes themselves."""

    def apply_to(self, episodes: Episodes | None) -> Episodes:
        """``episodes`` (the copy these changes follow) brought up to date; the whole episodes the first time."""
        if self.whole is not None:
            return self.whole
        if episodes is None:
            raise RuntimeError("straggler: episode changes arrived before the episodes they follow")
        episodes.merge(self)
        return episodes


def _extend(have: list[Any], at: int, new: list[Any]) -> None:
    if len(have) < at:
        raise RuntimeError(f"straggler: episode changes from entry {at} arrived after {len(have)} entries")
    have[at:] = new


class Episodes:
    """Verdicts, noise-level confirmations, the ladders (per rank, and one for the job with its log/alert levels
    only) and the decisions taken.

    Args:
        config: ``noise_level`` and the ladder's levels.
        rank: this rank (only rank 0 logs).
    """

    def __init__(self, config: StragglerConfig, rank: int) -> None:
        self.config, self.rank = config, rank
        self.ladder = ActionLadder(config.levels)
        self.job_ladder = ActionLadder([lvl for lvl in config.levels if lvl.action in ("log", "alert")])
        self.verdicts: list[StragglerFinding] = []
        self.noise_level: list[StragglerFinding] = []
        """Noise-level confirmations, the first of each streak."""
        self.noise_level_count = 0
        self._noise_last: dict[tuple[int, str], int] = {}
        self.decisions: list[Escalation] = []
        self.should_stop = False
        self.stop_decision: Escalation | None = None

    def changes(self, mark: EpisodeMark | None) -> tuple[EpisodeChanges | None, EpisodeMark]:
        """What changed since ``mark`` (None: nothing sent yet; the whole episodes), or None when nothing did; and the
        new mark."""
        rest = self._rest()
        digest = hashlib.blake2b(pickle.dumps(rest), digest_size=16).digest()
        now = (len(self.verdicts), len(self.noise_level), len(self.decisions), digest)
        if mark is None:
            return EpisodeChanges((0, 0, 0), [], [], [], None, whole=self), now
        if mark == now:
            return None, now
        v, n, d, sent = mark
        changes = EpisodeChanges(
            (v, n, d), self.verdicts[v:], self.noise_level[n:], self.decisions[d:], rest if digest != sent else None
        )
        return changes, now

    def merge(self, changes: EpisodeChanges) -> None:
        """Take ``changes`` made to the copy this one follows (the scoring process's)."""
        v, n, d = changes.start
        _extend(self.verdicts, v, changes.verdicts)
        _extend(self.noise_level, n, changes.noise_level)
        _extend(self.decisions, d, changes.decisions)
        if changes.rest is not None:
            self.noise_level_count, self.should_stop, self.stop_decision, self.ladder, self.job_ladder = changes.rest

    def _rest(self) -> tuple[Any, ...]:
        return self.noise_level_count, self.should_stop, self.stop_decision, self.ladder, self.job_ladder

    @property
    def active(self) -> list[StragglerFinding]:
        """Verdicts whose episode is still going on (stragglers, then a job-wide slowdown)."""
        return self.ladder.active + self.job_ladder.active

    def _ladder(self, rank: int) -> ActionLadder:
        return self.job_ladder if rank == JOB else self.ladder

    def update(
        self,
        i: int,
        rank: int,
        section: str,
        step: int,
        previous: int | None,
        events: ChangePointEvents,
        cusum: RobustCusum,
        *,
        score: str,
        nodes: Sequence[str],
        node_index: Sequence[int],
        evidence: Callable[[int], str] | None = None,
    ) -> list[Escalation]:
        """The flagged episode of series ``i`` (``rank`` in ``section``) after a change-point update: when just
        confirmed, a verdict if its slowdown stands out of the series' jitter, else a noise-level confirmation that
        is listed and dismissed (the test starts over); then the ladder of a verdict decides."""
        slowdown, scale = float(events.slowdown[i]), float(cusum.scale[i])
        if bool((events.started == i).any()):  # not np.isin: a sort per call, per flagged series
            verdict = StragglerFinding(
                rank=rank,
                node=nodes[rank] if rank != JOB else "",
                node_index=node_index[rank] if rank != JOB else -1,
                section=section,
                slowdown=slowdown,
                score=score,
                step=step,
                onset_step=cusum.onset(i),
                noise=math.expm1(scale) if math.isfinite(scale) else math.nan,
                scope="job" if rank == JOB else "rank",
                evidence=evidence(rank) if evidence is not None and rank != JOB else "",
            )
            if not (math.isfinite(slowdown) and math.log(slowdown) >= self.config.noise_level * scale):
                cusum.dismiss(step, np.array([i]))
                self._noise_level(verdict)
                return []
            self.verdicts.append(verdict)
            self._ladder(rank).start(verdict, previous)
        if not math.isfinite(slowdown):
            return []
        return self._ladder(rank).observe(rank, section, step, slowdown)

    def _noise_level(self, verdict: StragglerFinding) -> None:
        """List a noise-level confirmation once per streak (a series hovering in its jitter re-alarms often)."""
        self.noise_level_count += 1
        key = (verdict.rank, verdict.section)
        last = self._noise_last.get(key)
        self._noise_last[key] = verdict.step
        if last is not None and verdict.step - last <= 4 * self.config.confirm_steps * self.config.gather_every_n_steps:
            return
        self.noise_level.append(verdict)
        if self.rank == 0:
            log.info("straggler: noise-level, not a verdict: %s", verdict.describe())

    def ended(self, rank: int, section: str, step: int) -> None:
        """The episode of ``(rank, section)`` is over (the series is back within its hysteresis)."""
        ladder = self._ladder(rank)
        was_verdict = any(v.rank == rank and v.section == section for v in ladder.active)
        ladder.end(rank, section)
        if was_verdict and self.rank == 0:
            who = "the job" if rank == JOB else f"rank {rank}"
            log.info("straggler: %s is back to normal in '%s' at step %d", who, section, step)

    def act(self, decisions: list[Escalation]) -> None:
        """Carry out ``decisions`` (every rank calls it with the same ones)."""
        for decision in decisions:
            verdict = decision.verdict
            if decision.action is Action.LOG:
                if self.rank == 0:
                    log.warning("straggler: %s", verdict.describe())
            elif decision.action is Action.ALERT:
                if self.rank == 0:
                    log.error("straggler ALERT: %s (persisted %d steps)", verdict.describe(), decision.persist_steps)
            elif decision.action is Action.CHECKPOINT_AND_STOP:
                if self.rank == 0:
                    log.error("straggler STOP: %s; checkpoint and stop: restart without it", verdict.describe())
                self.should_stop = True
                if self.stop_decision is None:
                    self.stop_decision = decision
        self.decisions += decisions
