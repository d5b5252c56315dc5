"""Slowdown scores of every rank for one section: relative (against the other ranks at the same step) and individual
(against the rank's own best history).

Scores are slowdown factors: 1.0 is "as fast as the reference", 1.2 is "20% slower". NaN marks a rank that did not
report the section.
"""

from __future__ import annotations

import numpy as np

__all__ = ["IndividualBaseline", "relative_slowdowns"]


def relative_slowdowns(times: np.ndarray, reference: str = "median") -> np.ndarray:
    """Each rank's time divided by the median (or the minimum) of the OTHER ranks' times.

    Leaving the rank itself out keeps a single straggler from pulling its own reference up (with two ranks, the
    reference of each is the other one). Common-mode jitter (a slow batch on every rank) cancels out.

    Args:
        times: seconds per rank, NaN where a rank has no sample.
        reference: ``"median"`` or ``"fastest"`` of the other ranks.

    Returns:
        Slowdown per rank; NaN where the rank has no sample or no other rank has one.
    """
    times = np.asarray(times, dtype=np.float64)
    ok = times > 0  # NaN compares False
    n = int(np.count_nonzero(ok))
    if n < 2:
        return np.full(times.shape, np.nan)
    vals = times if n == times.size else times[ok]
    order = np.argsort(vals)
    ordered = vals[order]
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)  # position of each valid rank in the sorted values
    if reference == "fastest":
        ref = np.where(pos == 0, ordered[1], ordered[0])
    else:
        m = n - 1  # the others; the j-th smallest of them is ordered[j] below a rank's position, ordered[j+1] above
        j = m // 2
        ref = ordered[j + (j >= pos)]
        if m % 2 == 0:
            ref = 0.5 * (ordered[j - 1 + (j - 1 >= pos)] + ref)
    if n == times.size:
        return vals / ref
    out = np.full(times.shape, np.nan)
    out[ok] = vals / ref
    return out


class IndividualBaseline:
    """Each rank's best recent level: the lowest median over ``window`` consecutive samples seen so far (taken every
    ``window // 8`` updates).

    A median over a window is robust to spikes; the lowest one is the rank's "own best". Samples taken during a
    straggler episode are not fed in (the caller masks them), so a slow period never becomes the baseline.

    Args:
        world_size: number of ranks.
        window: samples per median.
        min_samples: samples needed before a rank has a baseline.
    """

    def __init__(self, world_size: int, window: int, min_samples: int) -> None:
        self.window = window
        self.min_samples = min(min_samples, window)
        self.refresh = max(1, window // 8)
        self._updates = 0
        self._ring = np.full((window, world_size), np.nan)
        self._count = np.zeros(world_size, dtype=np.int64)
        self.best = np.full(world_size, np.nan)

    def update(self, times: np.ndarray, mask: np.ndarray) -> None:
        """Feed ``times`` of the ranks where ``mask`` is set (and the time is valid)."""
        take = np.flatnonzero(mask & np.isfinite(times) & (times > 0))
        if take.size == 0:
            return
        self._ring[self._count[take] % self.window, take] = np.log(times[take])
        self._count[take] += 1
        self._updates += 1
        if self._updates % self.refresh == 0:  # the baseline moves slowly: the step must not pay a median each time
            self._refresh()

    def _refresh(self) -> None:
        full = np.flatnonzero(self._count >= self.window)
        if full.size:
            self.best[full] = np.fmin(self.best[full], np.exp(np.median(self._ring[:, full], axis=0)))
        for rank in np.flatnonzero((self._count >= self.min_samples) & (self._count < self.window)).tolist():
            level = float(np.exp(np.median(self._ring[: int(self._count[rank]), rank])))
            self.best[rank] = min(level, self.best[rank]) if np.isfinite(self.best[rank]) else level

    def slowdowns(self, times: np.ndarray) -> np.ndarray:
        """``times`` divided by each rank's baseline (NaN until a rank has one)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.asarray(times, dtype=np.float64) / self.best
