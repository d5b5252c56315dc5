"""The checkpoint benchmark's rotation on a fake clock: a turn's disk save comes on its first step, a write still
running is trained through (recorded), and the drain is timed apart, never folded into a step; the machine-load
verdict of a result."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from benchmarks import _common
from benchmarks._checkpoint import scenarios
from benchmarks._checkpoint.contenders import DISK_EVERY, Contender


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeStepClock:
    def __init__(self, clock: Clock) -> None:
        self.clock, self.marks = clock, []  # type: ignore[var-annotated]

    def mark(self) -> None:
        self.marks.append(self.clock.now)

    def intervals(self) -> list[float]:
        marks, self.marks = self.marks, []
        return [b - a for a, b in itertools.pairwise(marks)]


class Workload:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def step(self) -> None:
        self.clock.now += 1.0


class Writer(Contender):
    """Saves to disk on disk steps; the write stays busy for ``busy_steps`` steps; the drain costs 100 s."""

    name = "writer"

    def __init__(self, clock: Clock, busy_steps: int) -> None:
        super().__init__()
        self.clock, self.busy_steps = clock, busy_steps
        self.calls: list[tuple[int, bool]] = []
        self.starts: list[int] = []
        self.left = 0

    def begin(self) -> None:
        self.starts.append(len(self.calls))

    def after_step(self, step: int, disk: bool = True) -> None:
        self.calls.append((step, disk))
        self.left -= 1
        if disk and step % DISK_EVERY == 0:
            self.left = self.busy_steps

    def busy(self) -> bool:
        return self.left > 0

    def end_turn(self) -> None:
        if self.left > 0:
            self.clock.now += 100.0  # what is left of the write, drained
        super().end_turn()


@pytest.mark.parametrize("busy_steps", [3, 14, 40])
def test_the_disk_save_opens_each_turn_and_the_drain_is_never_a_step(
    monkeypatch: pytest.MonkeyPatch, busy_steps: int
) -> None:
    clock = Clock()
    monkeypatch.setattr(scenarios, "pc", clock)
    monkeypatch.setattr(scenarios, "StepClock", lambda device: FakeStepClock(clock))
    writer = Writer(clock, busy_steps)
    rec = scenarios.run_rotation(Workload(clock), [writer], warmup=7, turn=10, rounds=3)["writer"]  # type: ignore[arg-type]
    assert rec["step_s"] == [1.0] * len(rec["step_s"])  # no drain folded into a step
    tail = min(max(busy_steps - 9, 0), 10)  # busy for busy_steps calls after the one that saved
    assert rec["tail_steps"] == [tail] * 3 and len(rec["step_s"]) == 3 * (10 + tail)
    assert rec["drain_s"] == [100.0 if busy_steps > 19 else 0.0] * 3
    firsts = [writer.calls[i] for i in writer.starts]
    assert len(firsts) == 4 and all(step % DISK_EVERY == 0 and disk for step, disk in firsts)
    assert all(step % DISK_EVERY != 0 for step, disk in writer.calls if not disk)  # a tail step saves no disk


def test_slowdown_names_its_tail_by_the_samples_it_has() -> None:
    rec: dict[str, Any] = {
        name: {"step_s": [t] * n, "turn_s": [t * n], "drain_s": [0.0], "tail_steps": [0]}
        for name, t, n in (("none", 1.0, 50), ("x", 1.1, 50))
    }
    assert scenarios.slowdown(rec, "x")["tail"] == "max"
    rec = {k: {**v, "step_s": v["step_s"] * 3} for k, v in rec.items()}
    out = scenarios.slowdown(rec, "x")
    assert out["tail"] == "p99" and out["mean"] == pytest.approx(0.1)


def test_a_loaded_machine_is_refused_or_marked_unfit(monkeypatch: pytest.MonkeyPatch) -> None:
    machine = {"cores": 2, "loadavg_at_start": [2.5, 1.0, 1.0]}
    with pytest.raises(SystemExit, match=r"load average is 2\.50 on 2 cores"):
        _common.check_load_at_start(machine, allow=False)
    _common.check_load_at_start(machine, allow=True)
    _common.check_load_at_start(machine, allow=False, quick=True)
    monkeypatch.setattr(_common, "_loadavg", lambda: [0.5, 0.5, 0.5])
    _common.finish_load(machine)
    assert _common.unfit_reason({"machine": machine}) == "1-min load average 2.50 at the start on 2 cores"
    quiet = _common.finish_load({"cores": 2, "loadavg_at_start": [0.3, 0.3, 0.3]})
    assert quiet["load"]["fit_to_publish"] and _common.unfit_reason({"machine": quiet}) is None
    assert _common.unfit_reason({"machine": {"loadavg_at_start": [9.0]}}) is None  # an older result: not judged
