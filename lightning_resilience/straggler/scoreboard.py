"""Every tested series of a job in one vectorised change-point test.

One series per (section, rank): the rank's slowdown in that section, relative to the other ranks (or to its own best
history); and one series for the job: the smallest, over the ranks, of each rank's own work (compute and data wait)
against its own best history, which rises only when every rank got slower (a job-wide slowdown; a single straggler
makes the others *wait*, not work, longer). One :class:`RobustCusum` over all of them keeps the per-step cost to a
few dozen small array operations whatever the number of sections.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lightning_resilience.straggler.changepoint import MIN_HISTORY, ChangePointEvents, RobustCusum
from lightning_resilience.straggler.config import StragglerConfig
from lightning_resilience.straggler.kernels import KERNELS
from lightning_resilience.straggler.scores import (
    IndividualBaseline,
    excess_slowdowns,
    leave_one_out_complete,
    leave_one_out_reference,
)

__all__ = ["JOB", "WORK", "Scoreboard"]

JOB = -1
"""The "rank" of the job series."""
WORK = "work"
"""The section name of the job series: every rank's own work (compute and data wait)."""


class Scoreboard:
    """Scores and change points of ``sections`` x ranks, plus the job series.

    Args:
        sections: the tested sections, in order.
        world_size: number of ranks.
        config: the CUSUM, window and slowdown settings; ``job_verdicts`` adds the job series.
        relative: test the relative score (else the individual one; the ``kernels`` series is always relative).
    """

    def __init__(self, sections: Sequence[str], world_size: int, config: StragglerConfig, *, relative: bool) -> None:
        c = config
        self.sections, self.world_size = list(sections), world_size
        self.relative_mode, self.reference = relative, c.reference
        s, w = len(self.sections), world_size
        self.has_job = world_size > 1 and c.job_verdicts
        n = s * w + (1 if self.has_job else 0)
        self.cusum = RobustCusum(
            n,
            min_slowdown=np.array([c.min_slowdown] * (s * w) + [c.job_min_slowdown] * (n - s * w)),
            confirm_steps=c.confirm_steps,
            threshold=c.cusum_threshold,
            clip=c.cusum_clip,
            noise_floor=c.noise_floor,
            window=max(c.window, MIN_HISTORY),
        )
        # the sections' times, then every rank's work: each rank's own best levels
        self.baseline = IndividualBaseline(s * w + w, window=c.window, min_samples=MIN_HISTORY)
        self.relative = np.full((s, w), np.nan)
        self.individual = np.full((s, w), np.nan)
        self.rel_sum = np.zeros((s, w))
        self.rel_max = np.full((s, w), np.nan)
        self.rel_count = np.zeros((s, w), dtype=np.int64)
        self.job_last = math.nan
        """The latest job slowdown (smallest own-history slowdown of the ranks' work); NaN without the job series."""

    def series(self, index: int) -> tuple[int, str]:
        """(rank, section) of series ``index``; ``(JOB, WORK)`` for the job series."""
        if index == len(self.sections) * self.world_size:
            return JOB, WORK
        return index % self.world_size, self.sections[index // self.world_size]

    def index(self, rank: int, section: str) -> int:
        if rank == JOB:
            return len(self.sections) * self.world_size
        return self.sections.index(section) * self.world_size + rank

    def scale(self, section: str) -> np.ndarray:
        """The robust noise scale (log units) of ``section``'s series, per rank."""
        i = self.sections.index(section) * self.world_size
        return self.cusum.scale[i : i + self.world_size]

    def update(self, step: int, times: np.ndarray, work: np.ndarray) -> ChangePointEvents:
        """Score one exchange: ``times[s, r]`` seconds of section ``s`` on rank ``r`` (for ``kernels``: NVRx's
        slowdown factor), ``work[r]`` the rank's compute + data wait. Returns the change-point events (indices are
        series, see :meth:`series`)."""
        s, w = len(self.sections), self.world_size
        loo_work = leave_one_out_reference(work, self.reference, positive=True)
        best = self.baseline.best
        best_work = best[s * w :]
        for i, name in enumerate(self.sections):
            if name == KERNELS:  # already a relative factor against the fastest rank (NVRx)
                self.relative[i] = np.where(np.isfinite(times[i]), np.maximum(times[i], 1e-9), np.nan)
            else:
                self.relative[i] = excess_slowdowns(
                    times[i], leave_one_out_reference(times[i], self.reference), loo_work
                )
        self.individual = excess_slowdowns(times, best[: s * w].reshape(s, w), best_work)
        series = self.relative.copy() if self.relative_mode else self.individual.copy()
        for i, name in enumerate(self.sections):
            if name == KERNELS:
                series[i] = self.relative[i]
        flat = series.ravel()
        if self.has_job:
            with np.errstate(invalid="ignore", divide="ignore"):
                own = work / best_work
            self.job_last = float(own.min()) if np.all(np.isfinite(own)) else math.nan
            flat = np.append(flat, self.job_last)
        events = self.cusum.update(step, flat)
        flagged = self.cusum.flagged
        rank_flagged = flagged[: s * w].reshape(s, w).any(axis=0)
        calm_work = ~rank_flagged & ~(self.has_job and bool(flagged[-1]))  # slow periods never become baselines
        self.baseline.update(np.concatenate([times.ravel(), work]), np.concatenate([~flagged[: s * w], calm_work]))
        seen = np.isfinite(self.relative)
        self.rel_sum[seen] += self.relative[seen]
        self.rel_count += seen
        self.rel_max = np.fmax(self.rel_max, self.relative)
        return events

    @property
    def calm(self) -> bool:
        """No series is in an episode: :meth:`update_calm` may take samples."""
        return not self.cusum.flagged.any()

    def update_calm(self, steps: Sequence[int], times: np.ndarray, work: np.ndarray) -> int:
        """Score the leading samples of ``steps`` at once while the job is calm: ``times[t, s, r]`` and ``work[t, r]``
        as :meth:`update` takes them, one sample a row. Calm: every value measured, no series in an episode and
        none reaching its threshold. Returns how many samples were scored (up to the next refresh of a baseline or a
        noise scale, where the next call goes on), with the same state as one :meth:`update` each; 0 when they are
        not calm (the caller scores them one by one, which sees what happens)."""
        s, w = len(self.sections), self.world_size
        count = min(len(steps), self.cusum.until_refresh, self.baseline.until_refresh)
        if not (count and self.calm and w >= 2 and KERNELS not in self.sections):
            return 0
        # in float64 before any arithmetic, as update's functions convert them (a caller's may be float32)
        times, work = np.asarray(times[:count], np.float64), np.asarray(work[:count], np.float64)
        if not ((times >= 0).all() and (work > 0).all()):
            return 0  # NaN compares False: a value not measured is scored one by one
        best = self.baseline.best
        best_work = best[s * w :]
        loo_work = leave_one_out_complete(work, self.reference)[:, None, :]
        relative = excess_slowdowns(times, leave_one_out_complete(times, self.reference), loo_work)
        individual = excess_slowdowns(times, best[: s * w].reshape(s, w), best_work)
        flat = (relative if self.relative_mode else individual).reshape(count, s * w)
        if self.has_job:
            with np.errstate(invalid="ignore", divide="ignore"):
                own = work / best_work
            job = np.where(np.isfinite(own).all(axis=1), own.min(axis=1, initial=np.inf), np.nan)
            flat = np.concatenate([flat, job[:, None]], axis=1)
        if not self.cusum.update_calm(steps[:count], flat):
            return 0
        self.baseline.update_all(np.concatenate([times.reshape(count, s * w), work], axis=1))
        for row in relative:  # the running sums as update adds them, a sample at a time
            self.rel_sum += row
        self.rel_count += count
        self.rel_max = np.fmax(self.rel_max, np.fmax.reduce(relative, axis=0))
        self.relative, self.individual = relative[-1].copy(), individual[-1].copy()
        if self.has_job:
            self.job_last = float(flat[-1, -1])
        return count
