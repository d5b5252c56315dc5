"""Relative (leave-one-out) and individual slowdown scores."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from lightning_resilience.straggler.scores import (
    IndividualBaseline,
    nanmedian,
    relative_slowdowns,
)


def test_two_ranks_compare_with_each_other() -> None:
    rel = relative_slowdowns(np.array([1.0, 1.2]))
    assert rel == pytest.approx([1 / 1.2, 1.2])


@pytest.mark.parametrize("world", [3, 4, 5, 8, 51, 64])
def test_leave_one_out_median_matches_brute_force(world: int) -> None:
    """Exact against removing each rank in turn, ties included (the reference comes from a partition, not a sort)."""
    rng = np.random.default_rng(world)
    for trial in range(20):
        times = rng.lognormal(0.0, 0.2, world) if trial % 2 else 1.0 + rng.integers(0, 3, world).astype(float)
        expected = [times[r] / np.median(np.delete(times, r)) for r in range(world)]
        assert relative_slowdowns(times) == pytest.approx(expected)
        fastest = [times[r] / np.min(np.delete(times, r)) for r in range(world)]
        assert relative_slowdowns(times, "fastest") == pytest.approx(fastest)


def test_one_straggler_does_not_raise_its_own_reference() -> None:
    rel = relative_slowdowns(np.array([1.0, 1.0, 1.0, 2.0]))
    assert rel == pytest.approx([1.0, 1.0, 1.0, 2.0])


def test_missing_ranks_are_nan_and_excluded() -> None:
    rel = relative_slowdowns(np.array([1.0, math.nan, 1.5, 1.0]))
    assert math.isnan(rel[1])
    assert rel[[0, 2, 3]] == pytest.approx([1 / 1.25, 1.5, 1 / 1.25])
    assert np.isnan(relative_slowdowns(np.array([1.0, math.nan]))).all()


def test_individual_baseline_is_own_best_and_ignores_masked_samples() -> None:
    base = IndividualBaseline(2, window=8, min_samples=8)
    assert np.isnan(base.slowdowns(np.array([1.0, 1.0]))).all()
    for _ in range(8):
        base.update(np.array([1.0, 2.0]), np.array([True, True]))
    assert base.best == pytest.approx([1.0, 2.0])
    for _ in range(16):  # rank 0 is slower now but flagged: its baseline must not move
        base.update(np.array([3.0, 1.5]), np.array([False, True]))
    assert base.best == pytest.approx([1.0, 1.5])
    assert base.slowdowns(np.array([1.2, 3.0])) == pytest.approx([1.2, 2.0])


def test_row_medians_are_numpy_s_bit_for_bit_and_skip_nan() -> None:
    """The windows of the baseline and of the noise scale are rows, their medians one sort of them: the values of
    ``np.median`` without NaN (odd and even lengths), of ``np.nanmedian`` with, NaN for a row with no value."""
    rng = np.random.default_rng(3)
    for width in (1, 2, 7, 64):
        rows = rng.lognormal(-3.0, 0.3, (500, width))
        assert np.array_equal(nanmedian(rows, 1), np.median(rows, axis=1))
        assert np.array_equal(nanmedian(rows.T, 0), np.median(rows, axis=1))
        holes = rows.copy()
        holes[rng.random(holes.shape) < 0.3] = np.nan
        holes[0] = np.nan
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the all-NaN row
            expected = np.nanmedian(holes, axis=1)
        assert np.array_equal(nanmedian(holes, 1), expected, equal_nan=True)
