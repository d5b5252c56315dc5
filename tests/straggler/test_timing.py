"""StepTimer: steps, sections and data wait from an injected clock; CUDA events on a GPU."""

from __future__ import annotations

import pytest
import torch

from lightning_resilience.straggler.timing import COMPUTE, DATA, STEP, WAIT, CudaEventSource, StepTimer
from tests.straggler._sim import FakeClock


def test_step_sections_and_data_wait() -> None:
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    timer.start_step()
    with timer.section("forward"):
        clock.advance(0.25)
    clock.advance(0.5)
    timer.end_step()
    clock.advance(0.125)  # waiting for the next batch
    timer.start_step()
    timer.begin("optimizer")
    clock.advance(1.0)
    timer.end_step()  # closes the open section
    first, second = timer.collect()
    assert first == {"forward": 0.25, STEP: 0.75, COMPUTE: 0.75}
    assert second == {"optimizer": 1.0, STEP: 1.0, COMPUTE: 1.0, DATA: 0.125}
    assert timer.collect() == []


def test_compute_is_the_step_without_its_collective_waits_and_data_starts_after_the_exchange() -> None:
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    timer.start_step()
    clock.advance(0.3)  # forward
    with timer.section(WAIT):
        clock.advance(0.1)  # a buffer broadcast
    clock.advance(0.4)  # backward compute
    with timer.section(WAIT):
        clock.advance(0.5)  # the gradient all-reduce waits for a slower rank
    timer.end_step()
    clock.advance(0.2)  # exchange of timings: not a data wait
    timer.mark_idle()
    clock.advance(0.05)
    timer.start_step()
    timer.end_step()
    first, second = timer.collect()
    assert first[STEP] == pytest.approx(1.3) and first[WAIT] == pytest.approx(0.6)
    assert first[COMPUTE] == pytest.approx(0.7)
    assert second[DATA] == pytest.approx(0.05)


def test_repeated_section_sums_and_nesting_same_name_fails() -> None:
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    timer.start_step()
    for _ in range(3):
        with timer.section("micro"):
            clock.advance(0.5)
    with timer.section("outer"), pytest.raises(RuntimeError, match="already open"):
        timer.begin("outer")
    timer.end_step()
    (record,) = timer.collect()
    assert record["micro"] == 1.5


def test_outside_a_step_sections_are_ignored_and_reset_drops_data_wait() -> None:
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    with timer.section("x"):
        clock.advance(1.0)
    timer.end("never-opened")
    timer.end_step()
    assert timer.collect() == []
    timer.start_step()
    timer.end_step()
    clock.advance(5.0)  # validation ran here
    timer.reset_data_wait()
    timer.start_step()
    timer.end_step()
    assert all(DATA not in r for r in timer.collect())


def test_cancelled_step_is_not_recorded() -> None:
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    timer.start_step()
    timer.cancel_step()
    timer.end_step()
    assert timer.collect() == []


def test_cuda_source_refuses_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        CudaEventSource()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_time_device_work() -> None:
    timer = StepTimer(CudaEventSource())
    x = torch.randn(2048, 2048, device="cuda")
    timer.start_step()
    with timer.section("matmul"):
        for _ in range(10):
            x = x @ x
            x = x / x.norm()
    timer.end_step()
    (record,) = timer.collect(wait=True)
    assert 0 < record["matmul"] <= record[STEP]


class _LateSource:
    """Marks a device reads back late: a mark is ready once ``ready_upto`` has passed it (as CUDA events complete)."""

    def __init__(self) -> None:
        self.now, self.ready_upto = 0.0, -1.0

    def mark(self) -> float:
        self.now += 1.0
        return self.now

    def ready(self, mark: float) -> bool:
        return mark <= self.ready_upto

    def elapsed(self, start: float, end: float) -> float:
        return end - start


def test_a_step_read_back_late_keeps_the_name_it_was_given_when_it_ended() -> None:
    source = _LateSource()
    timer = StepTimer(source)
    for step in (7, 8, 9):
        timer.start_step()
        timer.end_step()
        timer.label_finished(step)
        if step == 8:
            source.ready_upto = source.now  # steps 7 and 8 have completed on the device; 9 has not yet
    assert [label for label, _ in timer.collect_labelled()] == [7, 8]
    timer.label_finished(10)  # a later call names nothing already named
    source.ready_upto = source.now
    assert [label for label, _ in timer.collect_labelled()] == [9]
    timer.start_step()
    timer.end_step()
    assert [label for label, _ in timer.collect_labelled(wait=True)] == [None]  # never named
