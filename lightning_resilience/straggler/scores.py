"""Slowdown scores of every rank for one section: relative (against the other ranks at the same step) and individual
(against the rank's own best history).

Scores are slowdown factors: 1.0 is "as fast as the reference", 1.2 is "20% slower". NaN marks a rank that did not
report the section. A section that is only part of a rank's work (the wait for data, the optimizer) is scored by
its *excess* over the reference as a share of the rank's whole work (:func:`excess_slowdowns`), so a data wait that
grows from 1 ms to 2 ms in a 100 ms step scores 1.01, not 2.0: what it costs the job, not its own ratio.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "IndividualBaseline",
    "excess_slowdowns",
    "into_ring",
    "leave_one_out_complete",
    "leave_one_out_reference",
    "nanmedian",
    "relative_slowdowns",
]


def nanmedian(a: np.ndarray, axis: int) -> np.ndarray:
    """``np.nanmedian(a, axis)`` of a 2-D array by one sort; NaN where a line has no value. Without NaN, the values of
    ``np.median`` bit for bit (the middle value, or the mean of the two middle ones).

    NumPy takes a masked-array path for short columns (0.1 s for 64 x 115k at 16,384 ranks), and ``np.median``
    partitions each line with two pivots, paying its setup per line; many short contiguous rows (a window of samples
    per series, ``axis=1``) sort with SIMD about 13x faster: 20 ms for 131k rows of 64, against 265 ms."""
    ordered = np.sort(a, axis=axis)  # NaN sort last
    n = a.shape[axis]
    if n and not np.isnan(ordered.take(n - 1, axis=axis)).any():  # no NaN at all (a full window): the middle values
        return 0.5 * (ordered.take((n - 1) // 2, axis=axis) + ordered.take(n // 2, axis=axis))
    k = np.expand_dims(np.count_nonzero(~np.isnan(a), axis=axis), axis)
    lo = np.take_along_axis(ordered, ((k - 1) // 2).clip(min=0), axis=axis)
    hi = np.take_along_axis(ordered, (k // 2).clip(max=max(n - 1, 0)), axis=axis)
    return np.where(k > 0, 0.5 * (lo + hi), np.nan).squeeze(axis)


def into_ring(ring: np.ndarray, written: np.ndarray, samples: np.ndarray) -> None:
    """Write ``samples`` (samples x series) into ``ring`` (series x slots) after each series' ``written`` samples, as
    one write per sample would: the newest ``slots`` of them land, each in its slot."""
    slots, skipped = ring.shape[1], max(0, samples.shape[0] - ring.shape[1])
    samples = samples[skipped:]
    at = (written[None, :] + np.arange(skipped, skipped + samples.shape[0])[:, None]) % slots
    ring[np.arange(ring.shape[0])[None, :], at] = samples


def leave_one_out_reference(times: np.ndarray, reference: str = "median", *, positive: bool = False) -> np.ndarray:
    """Per rank, the median (or the minimum) of the OTHER ranks' times.

    Leaving the rank itself out keeps a single straggler from pulling its own reference up (with two ranks, the
    reference of each is the other one).

    Args:
        times: seconds per rank, NaN where a rank has no sample.
        reference: ``"median"`` or ``"fastest"`` of the other ranks.
        positive: only times > 0 count as samples (else times >= 0).

    Returns:
        The reference per rank; NaN where the rank has no sample or no other rank has one.
    """
    times = np.asarray(times, dtype=np.float64)
    ok = times > 0 if positive else times >= 0  # NaN compares False
    n = int(np.count_nonzero(ok))
    if n < 2:
        return np.full(times.shape, np.nan)
    if n == times.size:
        return leave_one_out_complete(times, reference)
    out = np.full(times.shape, np.nan)
    out[ok] = leave_one_out_complete(times[ok], reference)
    return out


def leave_one_out_complete(values: np.ndarray, reference: str = "median") -> np.ndarray:
    """:func:`leave_one_out_reference` along the last axis of ``values`` where every value is a sample (at least two
    a line): one call for the ranks of many steps (``steps x ranks``), the same values as one call per step."""
    n = values.shape[-1]
    if n == 2:
        return values[..., ::-1].copy()
    # Only the order statistics next to the answer are needed, not every rank's position: a partition (O(N)), not a
    # sort. Removing a rank whose value is at most the k-th smallest v[k] shifts the others' k-th smallest to
    # v[k+1]; a larger value leaves it at v[k] (ties choose between equal values).
    m = n - 1  # the others
    j = 0 if reference == "fastest" else m // 2
    v = np.partition(values, sorted({max(j - 1, 0), j, j + 1}), axis=-1)
    at = lambda k: v[..., k : k + 1]  # noqa: E731  # the k-th smallest, for every line
    ref = np.where(values <= at(j), at(j + 1), at(j))
    if reference != "fastest" and m % 2 == 0:
        ref = 0.5 * (np.where(values <= at(j - 1), at(j), at(j - 1)) + ref)
    return np.asarray(ref, dtype=np.float64)


def relative_slowdowns(times: np.ndarray, reference: str = "median") -> np.ndarray:
    """Each rank's time divided by the median (or the minimum) of the OTHER ranks' times
    (:func:`leave_one_out_reference`); common-mode jitter (a slow batch on every rank) cancels out.

    Returns:
        Slowdown per rank; NaN where the rank has no sample or no other rank has one.
    """
    times = np.asarray(times, dtype=np.float64)
    return times / leave_one_out_reference(times, reference, positive=True)


def excess_slowdowns(times: np.ndarray, reference: np.ndarray, work_reference: np.ndarray) -> np.ndarray:
    """``1 + (time - reference) / work_reference``: a section's excess over its reference, as a share of the work.

    With ``times`` the whole work (``reference == work_reference``) this is ``time / reference``.

    Args:
        times: seconds in the section per rank (NaN: no sample).
        reference: the section's reference seconds per rank (the other ranks', or the rank's own best).
        work_reference: the reference seconds of the whole work (compute and data wait) per rank.

    Returns:
        Slowdown per rank (at least 0.001); NaN where a value is missing.
    """
    positive = work_reference > 0  # NaN compares False
    denominator = np.where(positive, work_reference, 1.0)  # no division by zero: those ranks come out NaN
    out = 1.0 + (np.asarray(times, np.float64) - reference) / denominator
    return np.where(positive & np.isfinite(out), np.maximum(out, 1e-3), np.nan)


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
        self._ring = np.full((world_size, window), np.nan)  # a series' window in one row: medians sort rows
        self._count = np.zeros(world_size, dtype=np.int64)
        self.best = np.full(world_size, np.nan)

    def update(self, times: np.ndarray, mask: np.ndarray) -> None:
        """Feed ``times`` of the ranks where ``mask`` is set (and the time is valid)."""
        take = np.flatnonzero(mask & np.isfinite(times) & (times >= 0))
        if take.size == 0:
            return
        self._ring[take, self._count[take] % self.window] = times[take]
        self._count[take] += 1
        self._updates += 1
        if self._updates % self.refresh == 0:  # the baseline moves slowly: the step must not pay a median each time
            self._refresh()

    @property
    def until_refresh(self) -> int:
        """Updates left until the levels are refreshed (after the last of them)."""
        return self.refresh - self._updates % self.refresh

    def update_all(self, times: np.ndarray) -> None:
        """Feed several updates of every rank at once (``times``: updates x ranks, all valid), no more than
        :attr:`until_refresh`: the same state as one :meth:`update` each with every rank in its mask."""
        if times.shape[0] > self.until_refresh:
            raise ValueError(f"{times.shape[0]} updates past the next refresh of the levels ({self.until_refresh})")
        into_ring(self._ring, self._count, times)
        self._count += times.shape[0]
        self._updates += times.shape[0]
        if self._updates % self.refresh == 0:
            self._refresh()

    def _refresh(self) -> None:
        ready = np.flatnonzero(self._count >= self.min_samples)
        if not ready.size:
            return
        ring = self._ring if ready.size == self._ring.shape[0] else self._ring[ready]
        level = nanmedian(ring, 1)  # unfilled slots: NaN
        self.best[ready] = np.fmin(self.best[ready], level)

    def slowdowns(self, times: np.ndarray) -> np.ndarray:
        """``times`` divided by each rank's baseline (NaN until a rank has one)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.asarray(times, dtype=np.float64) / self.best
