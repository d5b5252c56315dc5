"""The calm samples of an exchange are scored at once (``Scoreboard.update_calm``): the same verdicts, decisions and
state, to the bit, as scoring them one by one; and most samples of a calm job go that way."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from lightning_resilience.step.agreement import frame
from lightning_resilience.straggler.config import StragglerConfig
from lightning_resilience.straggler.detector import StragglerDetector
from lightning_resilience.straggler.exchange import decode_gathered, encode_payload
from lightning_resilience.straggler.scores import into_ring, leave_one_out_complete, leave_one_out_reference
from tests.straggler._sim import Cluster, jitter_cost

STEPS = 400


def _state(det: StragglerDetector) -> dict[str, Any]:
    board = det.scoreboard
    return {
        "relative": board.relative,
        "individual": board.individual,
        "rel_sum": board.rel_sum,
        "rel_max": board.rel_max,
        "rel_count": board.rel_count,
        "job_last": np.array(board.job_last),
        "cusum": board.cusum.cusum,
        "scale": board.cusum.scale,
        "last_zero": board.cusum.last_zero,
        "flagged": board.cusum.flagged,
        "best": board.baseline.best,
        # the rings the noise scales, the confirmations and the levels are read from (written at once when calm)
        "recent": board.cusum._recent,
        "recent_written": board.cusum._recent_idx,
        "hist": board.cusum._hist,
        "hist_written": board.cusum._hist_idx,
        "levels": board.baseline._ring,
        "levels_written": board.baseline._count,
        "history_steps": np.array([s for s, _ in det.history]),
        "history": np.array([[v for _, v in sorted(h.items())] for _, h in det.history]),
    }


def _run(
    world: int, config: StragglerConfig, cost: Any, *, calm: bool, wire: bool = False, pauses: tuple[int, ...] = ()
) -> tuple[Cluster, int]:
    """``wire``: every exchange as rank 0's scorer reads it, encoded and framed (timings in float32). ``pauses``:
    before these steps the ranks pause (a validation, an epoch's end), so their data wait is not measured."""
    cluster = Cluster(world, config, gather_every=config.gather_every_n_steps)
    taken = [0]
    for det in cluster.detectors:
        if wire:
            consume = det.consume

            def read(step: int, payloads: Any, _consume: Any = consume) -> Any:
                blob = frame([(r, encode_payload(p)) for r, p in enumerate(payloads)])
                return _consume(step, decode_gathered([blob]))

            det.consume = read  # type: ignore[method-assign]
        board = det.scoreboard
        if calm:
            real = board.update_calm

            def counted(*args: Any, _real: Any = real) -> int:
                n = int(_real(*args))
                taken[0] += n
                return n

            board.update_calm = counted  # type: ignore[method-assign]
        else:
            board.update_calm = lambda *args: 0  # type: ignore[method-assign]
    done = 0
    for pause in (*pauses, STEPS):
        cluster.run(pause - done, cost)
        done = pause
        for det in cluster.detectors:
            det.timer.reset_data_wait()
    return cluster, taken[0]


@pytest.mark.parametrize(
    ("world", "reference", "detect_on", "wire"),
    [
        (2, "median", "relative", False),
        (5, "median", "relative", False),
        (4, "fastest", "relative", False),
        (3, "median", "individual", False),
        (3, "median", "relative", True),
        (5, "median", "relative", True),
    ],
)
def test_calm_samples_scored_at_once_leave_the_same_state_as_one_by_one(
    world: int, reference: str, detect_on: str, wire: bool
):
    config = dataclasses.replace(StragglerConfig(), reference=reference, detect_on=detect_on)
    spikes = {(world - 1, 60): 3.0, (0, 61): 2.5}  # noise the test must not take for a straggler
    cost = lambda: jitter_cost(7, slow_rank=world - 1, factor=1.5, onset=220, spikes=spikes)  # noqa: E731
    one_by_one, untouched = _run(world, config, cost(), calm=False, wire=wire)
    at_once, taken = _run(world, config, cost(), calm=True, wire=wire)
    assert untouched == 0
    samples = STEPS - config.warmup_steps
    assert taken > samples * world // 2, f"only {taken} of {samples * world} samples went the calm way"
    for a, b in zip(one_by_one.detectors, at_once.detectors):
        assert a.verdicts == b.verdicts
        assert a.decisions == b.decisions
        for name, value in _state(a).items():
            assert np.array_equal(value, _state(b)[name], equal_nan=True), name
    if detect_on == "relative":
        assert any(v.rank == world - 1 for v in at_once.verdicts), "the slow rank was not named"


def test_a_job_wide_slowdown_is_scored_one_by_one_and_still_found():
    config = StragglerConfig()
    slower = jitter_cost(3)
    cost = lambda rank, step: slower(rank, step) * (1.6 if step >= 200 else 1.0)  # noqa: E731
    one_by_one, _ = _run(3, config, cost, calm=False)
    at_once, _ = _run(3, config, cost, calm=True)
    assert at_once.verdicts == one_by_one.verdicts
    assert any(v.scope == "job" for v in at_once.verdicts)


@pytest.mark.parametrize("width", [2, 3, 4, 7])
@pytest.mark.parametrize("reference", ["median", "fastest"])
def test_leave_one_out_over_many_steps_matches_one_step_at_a_time(width: int, reference: str):
    rng = np.random.default_rng(width)
    values = rng.lognormal(0.0, 0.2, size=(6, 3, width))
    values[1, 0, :] = 0.5  # ties
    at_once = leave_one_out_complete(values, reference)
    for index in np.ndindex(values.shape[:-1]):
        assert np.array_equal(at_once[index], leave_one_out_reference(values[index], reference))


def test_a_sample_not_measured_is_scored_alone_and_the_rest_of_its_exchange_still_goes_the_calm_way():
    """After a pause (validation, an epoch's end) a step's data wait is not measured: that sample alone is scored one
    by one, the samples before and after it in the same exchange go the calm way, and the state is the same."""
    config = StragglerConfig()
    pauses = tuple(range(37, STEPS, 37))  # inside exchanges, at a different sample of each
    cost = lambda: jitter_cost(5, slow_rank=2, factor=1.5, onset=250)  # noqa: E731
    one_by_one, _ = _run(3, config, cost(), calm=False, pauses=pauses)
    at_once, taken = _run(3, config, cost(), calm=True, pauses=pauses)
    assert one_by_one.verdicts == at_once.verdicts and any(v.rank == 2 for v in at_once.verdicts)
    for a, b in zip(one_by_one.detectors, at_once.detectors):
        assert a.decisions == b.decisions
        for name, value in _state(a).items():
            assert np.array_equal(value, _state(b)[name], equal_nan=True), name
    calm_before_onset = (250 - config.warmup_steps - len(pauses)) * 3  # every measured sample of the calm part
    assert taken >= calm_before_onset * 9 // 10, f"only {taken} samples went the calm way"


@pytest.mark.parametrize("count", [1, 3, 5, 8, 13])
def test_samples_written_into_rings_at_once_land_where_one_write_each_puts_them(count: int):
    rng = np.random.default_rng(count)
    slots, series = 5, 4
    written = rng.integers(0, 20, size=series)  # the series have written different numbers of samples so far
    samples = rng.random((count, series))
    one_by_one = np.full((series, slots), np.nan)
    at_once = one_by_one.copy()
    for t in range(count):
        one_by_one[np.arange(series), (written + t) % slots] = samples[t]
    into_ring(at_once, written, samples)
    np.testing.assert_array_equal(at_once, one_by_one)
