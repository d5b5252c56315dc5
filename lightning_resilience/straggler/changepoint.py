"""Change-point detection over per-rank slowdown series: a robust one-sided CUSUM, confirmed by a sustained slowdown.

For each rank the series is ``y = log(slowdown)`` (0 when the rank is as fast as its reference). The CUSUM
accumulates ``min(clip, (y - k) / sigma)`` and alarms when the sum reaches ``h``, where

* ``k = log(min_slowdown) / 2`` is half the smallest shift worth detecting (the classical CUSUM allowance), so a rank
  that is steadily 2-3% slower than its peers (different silicon) drifts down, not up;
* ``sigma`` is the rank's robust noise scale, 1.4826 x the median absolute deviation of its recent in-control
  samples (never below ``noise_floor``, refreshed every ``MIN_HISTORY`` updates; the largest of the last
  ``_SCALE_MEMORY`` estimates, each taken on its upper side, ``x (1 + 1/sqrt(n))`` for ``n`` samples, so a
  window that happens to be calm, or the short history at the start of a run, does not make ordinary jitter look
  like a shift), so the test adapts to how noisy the job is;
* ``clip`` bounds what one sample adds, so one spike alone cannot reach ``h``.

An alarm becomes a verdict only when the last ``confirm_steps`` samples, all but one (with ``confirm_steps >= 3``),
are themselves slowdowns of at least ``min_slowdown`` (the FALCON confirmation rule: a sustained change in the mean,
not outliers): a transient hiccup, even two spikes close together, fails it, while one dip of the straggler's own
noise does not delay the verdict. An episode ends
when the confirmation median stays below the midpoint ``exp(k)`` for ``2 x confirm_steps`` samples in a row
(hysteresis, so a rank hovering around the threshold is not flagged over and over). The change point
(onset) is estimated as the last sample at which the CUSUM was still zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_resilience.straggler.scores import into_ring, nanmedian

__all__ = ["MIN_HISTORY", "ChangePointEvents", "RobustCusum"]

MIN_HISTORY = 8
"""In-control samples a rank needs (for its noise scale) before it is tested; also the scale's refresh period."""

_MAD_TO_SIGMA = 1.4826
_SCALE_MEMORY = 4
_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class ChangePointEvents:
    """What one update changed: ranks newly confirmed as slow, ranks whose episode ended, and the current estimates."""

    started: np.ndarray
    """Ranks whose slowdown was just confirmed (a new episode)."""
    ended: np.ndarray
    """Ranks whose episode just ended (back below the midpoint ``sqrt(min_slowdown)``)."""
    slowdown: np.ndarray
    """Per rank in an episode or alarming: exp(median of the last ``confirm_steps`` samples); NaN elsewhere."""
    cusum: np.ndarray
    """Per rank: the CUSUM statistic after this update (in robust standard deviations)."""


class RobustCusum:
    """One-sided robust CUSUM with confirmation, vectorised over ranks.

    Args:
        world_size: number of series (ranks, or ranks x sections).
        min_slowdown: smallest slowdown factor worth a verdict (one for all series, or one per series).
        confirm_steps: recent samples that must show ``min_slowdown`` (all but one when >= 3).
        threshold: CUSUM decision threshold ``h`` (robust standard deviations).
        clip: largest contribution of one sample (robust standard deviations).
        noise_floor: smallest noise scale assumed (log units).
        window: in-control samples kept per rank for the noise scale.
    """

    def __init__(
        self,
        world_size: int,
        *,
        min_slowdown: float | np.ndarray,
        confirm_steps: int,
        threshold: float,
        clip: float,
        noise_floor: float,
        window: int,
    ) -> None:
        assert world_size >= 1 and confirm_steps >= 1 and window >= MIN_HISTORY
        self.world_size = world_size
        self.log_min = np.log(np.broadcast_to(np.asarray(min_slowdown, dtype=np.float64), (world_size,))).copy()
        self.allowance = self.log_min / 2
        self.confirm_steps = confirm_steps
        self._dips = 1 if confirm_steps >= 3 else 0
        self.threshold = threshold
        self.clip = clip
        self.noise_floor = noise_floor
        self.window = window
        self.cusum = np.zeros(world_size)
        self.flagged = np.zeros(world_size, dtype=bool)
        self.last_zero = np.full(world_size, -1, dtype=np.int64)
        self._recent = np.full((confirm_steps, world_size), np.nan)
        self._recent_idx = np.zeros(world_size, dtype=np.int64)
        self._hist = np.full((world_size, window), np.nan)  # a series' samples in one row: medians sort rows
        self._hist_idx = np.zeros(world_size, dtype=np.int64)
        self._calm = np.zeros(world_size, dtype=np.int64)
        self.scale = np.full(world_size, np.nan)
        self._scales = np.full((_SCALE_MEMORY, world_size), np.nan)
        self._updates = 0

    def update(self, step: int, slowdown: np.ndarray) -> ChangePointEvents:
        """Feed one sample per rank (NaN: no sample for that rank this time)."""
        x = np.asarray(slowdown, dtype=np.float64)
        valid = x > 0  # NaN compares False
        y = np.log(np.where(valid, x, 1.0))
        ranks = np.flatnonzero(valid)
        self._recent[self._recent_idx[ranks] % self.confirm_steps, ranks] = y[ranks]
        self._recent_idx[ranks] += 1

        testable = valid & (self.scale > 0)  # a rank is tested once it has a noise scale
        z = np.clip((y - self.allowance) / np.where(testable, self.scale, 1.0), -self.clip, self.clip)
        self.cusum = np.where(testable, np.maximum(0.0, self.cusum + z), self.cusum)
        self.last_zero[valid & (self.cusum == 0.0)] = step

        # the confirmation median is needed only where the CUSUM alarms or an episode runs (rarely): skip the rest
        cand = np.flatnonzero(
            ((self.cusum >= self.threshold) | self.flagged) & (self._recent_idx >= self.confirm_steps)
        )
        med = np.full(self.world_size, np.nan)
        started = ended = _EMPTY
        if cand.size:
            rows = np.sort(self._recent[:, cand], axis=0)
            med[cand] = _median_sorted(rows)
            confirmed = np.zeros(self.world_size, dtype=bool)
            # sustained, not spikes: all recent samples but one (a dip of the straggler's own noise) are slow
            confirmed[cand] = rows[self._dips] >= self.log_min[cand]
            started = np.flatnonzero(testable & ~self.flagged & (self.cusum >= self.threshold) & confirmed)
            self.flagged[started] = True
            self._calm[started] = 0

            # hysteresis: an episode ends only once the rank is back below the midpoint (not merely below
            # min_slowdown) for 2 x confirm_steps samples in a row, so a rank hovering around the threshold is not
            # re-flagged endlessly
            ongoing = self.flagged & valid
            ongoing[started] = False
            calm_now = med < self.allowance
            self._calm[ongoing & ~calm_now] = 0
            self._calm[ongoing & calm_now] += 1
            ended = np.flatnonzero(ongoing & (self._calm >= 2 * self.confirm_steps))
            self.flagged[ended] = False
            self.cusum[ended] = 0.0
            self.last_zero[ended] = step

        # only in-control samples shape the noise scale: a slow episode must not teach the test that slow is normal
        calm_mask = valid & ~self.flagged
        calm_mask[ended] = False
        calm = np.flatnonzero(calm_mask)
        self._hist[calm, self._hist_idx[calm] % self.window] = y[calm]
        self._hist_idx[calm] += 1
        self._updates += 1
        if self._updates % MIN_HISTORY == 0:
            self._refresh_scale()
        return ChangePointEvents(started=started, ended=ended, slowdown=np.exp(med), cusum=self.cusum.copy())

    @property
    def until_refresh(self) -> int:
        """Updates left until the noise scale is refreshed (after the last of them)."""
        return MIN_HISTORY - self._updates % MIN_HISTORY

    def update_calm(self, steps: Sequence[int], slowdown: np.ndarray) -> bool:
        """Feed ``len(steps)`` samples of every series at once (``slowdown``: steps x series, all valid) when no
        series is in an episode and none reaches the threshold on the way; no more than :attr:`until_refresh`.
        The same state as one :meth:`update` per step; False (nothing changed) where they would do more than count:
        the caller then feeds the samples one by one."""
        if len(steps) > self.until_refresh:
            raise ValueError(f"{len(steps)} samples past the next refresh of the noise scale ({self.until_refresh})")
        if self.flagged.any() or not bool((slowdown > 0).all()):
            return False
        y = np.log(slowdown)
        testable = self.scale > 0
        z = np.clip((y - self.allowance) / np.where(testable, self.scale, 1.0), -self.clip, self.clip)
        count = len(steps)
        sums = np.empty((count, self.world_size))
        cusum = self.cusum
        for t in range(count):  # the recursion, step by step (the same rounding as update)
            cusum = sums[t] = np.where(testable, np.maximum(0.0, cusum + z[t]), cusum)
        if (sums >= self.threshold).any():
            return False
        # the samples into each series' rings at once (only the newest that a ring holds: no slot written twice)
        into_ring(self._recent.T, self._recent_idx, y)
        self._recent_idx += count
        into_ring(self._hist, self._hist_idx, y)
        self._hist_idx += count
        zero = sums == 0.0
        hit = zero.any(axis=0)
        newest = count - 1 - np.argmax(zero[::-1], axis=0)  # the last sample at which each CUSUM was zero
        self.last_zero[hit] = np.asarray(steps, dtype=np.int64)[newest[hit]]
        self.cusum = cusum
        self._updates += count
        if self._updates % MIN_HISTORY == 0:
            self._refresh_scale()
        return True

    def _refresh_scale(self) -> None:
        """The noise scale moves slowly: refreshed every MIN_HISTORY updates, not every step."""
        ready = np.flatnonzero(self._hist_idx >= MIN_HISTORY)
        if not ready.size:
            return
        hist = self._hist if ready.size == self._hist.shape[0] else self._hist[ready]
        mad = nanmedian(np.abs(hist - nanmedian(hist, 1)[:, None]), 1)  # unfilled slots: NaN
        # few samples give a rough estimate: take its upper side (x1.35 from 8 samples, x1.125 from 64)
        n = np.minimum(self._hist_idx[ready], self.window)
        self._scales[(self._updates // MIN_HISTORY) % _SCALE_MEMORY, ready] = _MAD_TO_SIGMA * mad * (1 + n**-0.5)
        self.scale[ready] = np.maximum(self.noise_floor, np.nanmax(self._scales[:, ready], axis=0))

    def dismiss(self, step: int, ranks: np.ndarray) -> None:
        """End the episodes of ``ranks`` at once, as noise: their samples count as in-control again (a false alarm
        must not teach the noise scale that the jitter is smaller than it is) and the test starts over."""
        self.flagged[ranks] = False
        self.cusum[ranks] = 0.0
        self.last_zero[ranks] = step
        self._calm[ranks] = 0

    def onset(self, rank: int) -> int:
        """Estimated change point of ``rank``: the step after the CUSUM was last zero."""
        return int(self.last_zero[rank]) + 1


def _median_sorted(rows: np.ndarray) -> np.ndarray:
    """Column medians of a small array sorted along axis 0 (cheaper than np.median for a handful of rows)."""
    n = rows.shape[0]
    return rows[n // 2] if n % 2 else 0.5 * (rows[n // 2 - 1] + rows[n // 2])
