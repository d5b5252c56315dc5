"""RobustCusum: detects a sustained shift quickly, ignores noise, bias, spikes and one-off hiccups."""

from __future__ import annotations

import numpy as np

from lightning_resilience.straggler.changepoint import MIN_HISTORY, RobustCusum


def _cusum(world: int = 4, **kw: float) -> RobustCusum:
    args: dict = dict(min_slowdown=1.1, confirm_steps=4, threshold=5.0, clip=4.0, noise_floor=0.01, window=64)
    args.update(kw)
    return RobustCusum(world, **args)


def _noisy(rng: np.random.Generator, world: int, sigma: float = 0.03) -> np.ndarray:
    return np.exp(rng.normal(0.0, sigma, world))


def test_sustained_shift_is_confirmed_within_a_few_samples_and_onset_is_estimated() -> None:
    rng = np.random.default_rng(0)
    cp = _cusum()
    for step in range(100):
        assert cp.update(step, _noisy(rng, 4)).started.size == 0
    found = None
    for step in range(100, 120):
        x = _noisy(rng, 4)
        x[2] *= 1.2
        events = cp.update(step, x)
        if events.started.size:
            found = step
            assert events.started.tolist() == [2]
            assert 1.1 < events.slowdown[2] < 1.35
            break
    assert found is not None and found - 100 + 1 <= 5  # at most 5 slow samples seen
    assert 97 <= cp.onset(2) <= 101


def test_clean_noise_and_a_steady_bias_never_alarm() -> None:
    rng = np.random.default_rng(1)
    cp = _cusum()
    for step in range(3000):
        x = _noisy(rng, 4)
        x[0] *= 1.03  # a rank that is always 3% slower (different silicon) is not a straggler
        assert cp.update(step, x).started.size == 0, step


def test_isolated_spikes_never_make_a_verdict() -> None:
    rng = np.random.default_rng(2)
    cp = _cusum()
    for step in range(2000):
        x = _noisy(rng, 4)
        if step % 37 == 0:
            x[step % 4] *= 5.0  # a huge one-off hiccup
        if step % 101 == 0:
            x[1] *= 3.0
            x[3] *= 3.0
        assert cp.update(step, x).started.size == 0, step


def test_two_spikes_in_a_row_are_not_sustained_but_one_dip_does_not_delay() -> None:
    rng = np.random.default_rng(3)
    cp = _cusum()
    for step in range(60):
        cp.update(step, _noisy(rng, 4))
    for step in range(60, 200):
        x = _noisy(rng, 4)
        if step % 20 in (0, 1):  # two big spikes back to back on the same rank
            x[2] *= 3.0
        assert cp.update(step, x).started.size == 0, step
    found = []
    for i, step in enumerate(range(200, 210)):
        x = _noisy(rng, 4)
        x[1] *= 1.0 if i == 1 else 1.3  # the straggler's second slow sample dips back to normal
        found += [step] * cp.update(step, x).started.size
    assert found == [203]  # 4 samples, 3 of them slow: confirmed at the 4th without waiting for 4 slow ones


def test_not_tested_before_enough_history() -> None:
    cp = _cusum(world=2)
    for step in range(MIN_HISTORY):
        assert cp.update(step, np.array([3.0, 1.0])).started.size == 0
    started = [cp.update(step, np.array([3.0, 1.0])).started.tolist() for step in range(MIN_HISTORY, MIN_HISTORY + 3)]
    assert [0] in started  # slow from the start: found once the rank has a noise scale


def test_episode_ends_with_hysteresis_and_can_restart() -> None:
    cp = _cusum(world=2)
    step = 0
    for _ in range(20):
        cp.update(step, np.array([1.0, 1.0]))
        step += 1
    starts, ends = [], []
    for x in [1.5] * 10 + [1.08] * 20 + [1.0] * 20 + [1.5] * 10:
        events = cp.update(step, np.array([x, 1.0]))
        starts += [step] * events.started.size
        ends += [step] * events.ended.size
        step += 1
    # 1.08 is below min_slowdown but above the midpoint sqrt(1.1): the episode goes on; it ends at 1.0
    assert len(starts) == 2 and len(ends) == 1
    assert 50 < ends[0] <= 50 + 4 + 8  # back to 1.0 at step 50; 2 x confirm_steps calm medians later
    assert not cp.flagged[1]


def test_nan_samples_are_skipped() -> None:
    cp = _cusum(world=3)
    for step in range(30):
        events = cp.update(step, np.array([1.0, np.nan, 1.0]))
        assert events.started.size == 0
    assert np.isnan(cp.scale[1]) and cp.cusum[1] == 0.0
