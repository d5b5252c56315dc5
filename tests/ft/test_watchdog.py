"""Watchdog and timeout calibration, decided with a fake clock; the thread is woken by events, never by sleeps."""

from __future__ import annotations

import math
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from lightning_resilience.ft.config import FaultToleranceConfig
from lightning_resilience.ft.restart import read_fault_notes
from lightning_resilience.ft.watchdog import Hang, HangHandler, TimeoutCalibrator, Watchdog, dump_stacks

WAIT_S = 10.0  # bound on waiting for the watchdog thread to react to a poke


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _calibrator(**kw: object) -> TimeoutCalibrator:
    args: dict = dict(
        initial={"setup": 100.0, "step": 50.0, "out_of_section": 40.0},
        safety_factor=4.0,
        warmup={"step": 3, "out_of_section": 3},
        min_s=2.0,
        max_s=30.0,
    )
    args.update(kw)
    return TimeoutCalibrator(**args)


def test_initial_timeouts_until_warmed_up_then_safety_factor_times_longest() -> None:
    cal = _calibrator()
    cal.observe("step", 1.0)
    cal.observe("step", 2.0)
    assert cal.timeout("step") == 50.0 and not cal.calibrated("step")
    cal.observe("step", 1.5)
    assert cal.calibrated("step") and cal.timeout("step") == pytest.approx(8.0)  # 4 x longest (2.0)
    assert cal.timeout("unknown") == math.inf


def test_a_first_observation_sets_a_provisional_timeout_until_warmed_up() -> None:
    cal = _calibrator(provisional_factor=2.0, initial={"step": 50.0, "out_of_section": 12.0})
    assert cal.basis("step") == "initial" and cal.timeout("step") == 50.0
    cal.observe("step", 1.0)  # the first step (compilation)
    assert cal.basis("step") == "provisional" and cal.timeout("step") == pytest.approx(8.0)  # 2 x 4 x 1.0
    cal.observe("step", 0.5)
    assert cal.timeout("step") == pytest.approx(8.0)  # only grows
    cal.observe("out_of_section", 5.0)
    assert cal.timeout("out_of_section") == 12.0  # never above the initial timeout
    cal.observe("step", 0.5)
    assert cal.basis("step") == "calibrated" and cal.timeout("step") == pytest.approx(4.0)
    restarted = _calibrator(provisional_factor=2.0, initial={"step": 50.0, "out_of_section": 12.0})
    restarted.load_state_dict(cal.state_dict())
    assert restarted.basis("out_of_section") == "provisional" and restarted.timeout("out_of_section") == 12.0
    off = _calibrator()  # provisional_factor 0: the initial timeout until warm-up
    off.observe("step", 1.0)
    assert off.basis("step") == "initial" and off.timeout("step") == 50.0


def test_a_hang_at_step_two_is_found_at_the_provisional_deadline() -> None:
    clock = FakeClock()
    hangs: list[Hang] = []
    fired = threading.Event()
    cal = _calibrator(provisional_factor=2.0, min_s=5.0)
    dog = Watchdog(cal, lambda h: (hangs.append(h), fired.set()), clock=clock)
    dog.start()
    try:
        dog.switch("step", step=1)
        clock.advance(0.5)
        dog.switch("step", step=2)  # step 1 took 0.5 s: provisional max(2 x 4 x 0.5, 5) = 5 s, not the initial 50
        clock.advance(5.5)
        dog.poke()
        assert fired.wait(WAIT_S)
    finally:
        dog.stop()
    assert [(h.section, h.step, h.basis, h.timeout_s) for h in hangs] == [("step", 2, "provisional", 5.0)]


def test_calibrated_timeouts_are_clamped_and_only_grow() -> None:
    cal = _calibrator()
    for _ in range(3):
        cal.observe("step", 0.01)
    assert cal.timeout("step") == 2.0  # 4 x 0.01 is below the floor
    cal.observe("step", 100.0)
    assert cal.timeout("step") == 30.0  # capped
    cal.observe("step", 0.01)
    assert cal.timeout("step") == 30.0  # a fast step never lowers it


def test_uncalibrated_sections_keep_their_initial_timeout() -> None:
    cal = _calibrator(sections=["step"])
    cal.observe("setup", 1.0)
    assert cal.timeout("setup") == 100.0 and not cal.calibrated("setup")
    cal.observe("out_of_section", 1.0)
    assert cal.timeout("out_of_section") == 40.0


def test_calibration_round_trips_so_a_restart_starts_calibrated() -> None:
    cal = _calibrator()
    for d in (1.0, 3.0, 2.0):
        cal.observe("step", d)
    restarted = _calibrator()
    restarted.load_state_dict(cal.state_dict())
    assert restarted.calibrated("step") and restarted.timeout("step") == pytest.approx(12.0)
    restarted.observe("step", 1.0)  # merging keeps what was learnt
    assert restarted.timeout("step") == pytest.approx(12.0)


class _Recorder:
    def __init__(self) -> None:
        self.hangs: list[Hang] = []
        self.event = threading.Event()

    def __call__(self, hang: Hang) -> None:
        self.hangs.append(hang)
        self.event.set()


def _watchdog(clock: FakeClock, cal: TimeoutCalibrator | None = None) -> tuple[Watchdog, _Recorder]:
    rec = _Recorder()
    # a long max wait: only pokes and switches wake the thread, so the fake clock alone decides
    return Watchdog(cal or _calibrator(), rec, clock=clock, max_wait_s=3600.0), rec


def test_hang_in_a_section_is_reported_once_with_section_step_and_duration() -> None:
    clock = FakeClock()
    wd, rec = _watchdog(clock)
    wd.switch("setup", step=0)
    wd.start()
    try:
        clock.advance(99.0)
        wd.poke()
        assert not rec.event.wait(0.2)  # within its initial timeout: nothing
        clock.advance(2.0)
        wd.poke()
        assert rec.event.wait(WAIT_S)
        assert rec.hangs == [Hang("setup", 0, 101.0, 100.0, basis="initial")]
    finally:
        wd.stop(timedelta(seconds=WAIT_S))


def test_calibrated_step_timeout_detects_a_stuck_step_and_switching_resets_the_deadline() -> None:
    clock = FakeClock()
    wd, rec = _watchdog(clock)
    wd.start()
    try:
        for step in range(1, 4):  # warm-up: three steps of 1 s, 0.5 s between them
            wd.switch("step", step)
            clock.advance(1.0)
            wd.switch("out_of_section", step)
            clock.advance(0.5)
        assert wd.calibrator.timeout("step") == pytest.approx(4.0)
        wd.switch("step", 4)
        clock.advance(3.9)
        wd.poke()
        assert wd.check() is None and not rec.event.wait(0.2)
        wd.switch("out_of_section", 4)  # the step ended in time: a new deadline, and a longer step seen
        assert wd.calibrator.timeout("step") == pytest.approx(4 * 3.9)
        clock.advance(0.1)
        wd.switch("step", 5)
        clock.advance(16.0)  # a stuck step (a rank in a collective its peers never join)
        wd.poke()
        assert rec.event.wait(WAIT_S)
        (hang,) = rec.hangs
        assert (hang.section, hang.step, hang.calibrated) == ("step", 5, True)
        assert hang.stuck_for_s == pytest.approx(16.0) and hang.timeout_s == pytest.approx(15.6)
    finally:
        wd.stop(timedelta(seconds=WAIT_S))


def test_no_section_open_means_nothing_is_timed() -> None:
    clock = FakeClock()
    wd, rec = _watchdog(clock)
    wd.start()
    wd.switch("step", 1)
    wd.switch(None)
    clock.advance(1e6)
    wd.poke()
    assert not rec.event.wait(0.2)
    wd.stop(timedelta(seconds=WAIT_S))
    assert rec.hangs == []


def test_stop_reraises_an_error_of_the_watchdog_thread() -> None:
    clock = FakeClock()
    called = threading.Event()

    def broken(hang: Hang) -> None:
        called.set()
        raise ValueError("handler broke")

    wd = Watchdog(_calibrator(), broken, clock=clock, max_wait_s=3600.0)
    wd.switch("setup", 0)
    wd.start()
    clock.advance(200.0)
    wd.poke()
    assert called.wait(WAIT_S)
    with pytest.raises(RuntimeError, match="watchdog thread failed") as info:
        wd.stop(timedelta(seconds=WAIT_S))
    assert isinstance(info.value.__cause__, ValueError)


def test_hang_handler_dumps_all_stacks_and_leaves_a_fault_note(tmp_path: Path) -> None:
    handler = HangHandler(tmp_path, rank=3, attempt=2, exit=False, wall_clock=lambda: 5000.0)
    started, release = threading.Event(), threading.Event()

    def _peer_thread_marker() -> None:
        started.set()
        release.wait(WAIT_S)

    peer = threading.Thread(target=_peer_thread_marker)
    peer.start()
    try:
        assert started.wait(WAIT_S)
        handler(Hang("step", 17, 12.5, 10.0, basis="calibrated"))
    finally:
        release.set()
        peer.join(WAIT_S)
    stacks = (tmp_path / "stacks" / "attempt2_rank3.txt").read_text()
    assert "_peer_thread_marker" in stacks  # every thread, not only the caller's
    assert "test_hang_handler_dumps_all_stacks" in stacks
    (note,) = read_fault_notes(tmp_path)
    assert (note.kind, note.rank, note.attempt, note.step, note.section) == ("hang", 3, 2, 17, "step")
    assert note.detection_s == 12.5 and note.timeout_s == 10.0 and note.stacks and note.stacks.endswith(".txt")


def test_dump_stacks_creates_the_directory(tmp_path: Path) -> None:
    path = dump_stacks(tmp_path / "a" / "b.txt")
    assert "test_dump_stacks_creates_the_directory" in path.read_text()


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"safety_factor": 0.5}, "ft.safety_factor"),
        ({"warmup_steps": 0}, "ft.warmup_steps"),
        ({"provisional_factor": 0.5}, "ft.provisional_factor"),
        ({"min_timeout_s": 10.0, "max_timeout_s": 5.0}, "ft.max_timeout_s"),
        ({"initial_timeouts_s": {"stp": 1.0}}, "ft.initial_timeouts_s"),
        ({"initial_timeouts_s": {"step": -1.0}}, "ft.initial_timeouts_s.step"),
        ({"preemption_signals": ["SIGKILL"]}, "ft.preemption_signals"),
        ({"preemption_signals": ["SIGNOPE"]}, "ft.preemption_signals"),
        ({"nvrx": "maybe"}, "ft.nvrx"),
        ({"calibrated_sections": ["steps"]}, "ft.calibrated_sections"),
    ],
)
def test_config_rejects_bad_values_naming_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        FaultToleranceConfig(**kwargs)


def test_config_fills_missing_initial_timeouts() -> None:
    cfg = FaultToleranceConfig(initial_timeouts_s={"step": 5.0}, preemption_signals=["SIGTERM", "SIGUSR1"])
    assert cfg.initial_timeouts_s["step"] == 5.0 and cfg.initial_timeouts_s["setup"] == 900.0
    assert [s.name for s in cfg.signals] == ["SIGTERM", "SIGUSR1"]


def test_hang_handler_still_ends_the_process_when_recording_fails(tmp_path: Path) -> None:
    """A run directory that cannot be written must not keep a hung rank alive: the exit runs in any case."""
    import subprocess
    import sys

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the run directory should be")
    code = (
        "from pathlib import Path; from lightning_resilience.ft.watchdog import Hang, HangHandler; "
        f"HangHandler(Path({str(blocker)!r}), rank=0, attempt=0)(Hang('step', 1, 2.0, 1.0, True))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    from lightning_resilience.exit_codes import ExitCode

    HANG_EXIT_CODE = int(ExitCode.HANG)

    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-2000:]


def test_a_switch_wakes_the_thread_only_when_it_would_check_too_late() -> None:
    """An ordinary step sets no event: the thread's own wake-up comes before the step's deadline."""
    clock = FakeClock()
    dog = Watchdog(_calibrator(initial={"step": 50.0, "quick": 0.5}), lambda h: None, clock=clock, max_wait_s=1.0)
    dog.switch("step", step=1)
    assert dog.wakes == 1  # the thread's wake-up is not known yet
    assert dog.next_check() == pytest.approx(1.0)  # what the thread does before it waits: at most max_wait_s
    for step in range(2, 100):
        clock.advance(0.01)
        dog.switch("step", step=step)
        dog.switch(None)  # out of any section: nothing to check sooner
    assert dog.wakes == 1
    clock.advance(0.5)  # past the thread's wake-up: it is checking by itself now
    dog.switch("step", step=100)
    assert dog.wakes == 1
    assert dog.next_check() == pytest.approx(1.0)
    dog.switch("quick")  # due in 0.5 s, before the thread's own check
    assert dog.wakes == 2


def test_a_short_section_opened_during_a_long_wait_is_timed_at_its_own_deadline() -> None:
    """Real clock and thread: the thread waits up to 60 s by itself; a section with a 50 ms timeout wakes it."""
    fired = threading.Event()
    hangs: list[Hang] = []
    dog = Watchdog(
        _calibrator(initial={"step": 50.0, "quick": 0.05}, enabled=False),
        lambda h: (hangs.append(h), fired.set()),
        max_wait_s=60.0,
    )
    dog.start()
    try:
        dog.switch("step", step=1)
        dog.switch("quick", step=2)
        assert fired.wait(WAIT_S)
    finally:
        dog.stop()
    assert [(h.section, h.step) for h in hangs] == [("quick", 2)]
