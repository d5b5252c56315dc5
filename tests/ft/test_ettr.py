"""The ETTR ledger: attempts survive restarts (a new ledger object per attempt, as a new process would make), fault
notes left by ranks become the cause of an attempt's end, and the time accounting adds up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_resilience.ft.ettr import LEDGER_FILE, EttrLedger, account
from lightning_resilience.ft.restart import FaultNote, atomic_write_json, current_attempt, write_fault_note


class WallClock:
    def __init__(self, now: float = 10_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _run_steps(ledger: EttrLedger, clock: WallClock, start: int, end: int, step_s: float, blocking: float) -> None:
    clock.now += 0.5  # set-up before the first step
    ledger.first_step(start)
    for step in range(start + 1, end + 1):
        clock.now += step_s
        ledger.heartbeat(step, checkpoint_blocking_s=blocking * (step - start) / (end - start))


def _attempt(run_dir: Path, clock: WallClock, restart_count: int) -> EttrLedger:
    ledger = EttrLedger(run_dir, wall_clock=clock, interval_s=0.0)  # a new process reads the file
    ledger.begin_attempt(restart_count=restart_count, launcher="torchrun", world_size=2, job_id="j")
    return ledger


def test_hang_then_resume_accounts_gap_detection_and_recomputation(tmp_path: Path) -> None:
    clock = WallClock()
    t0 = clock.now
    ledger = _attempt(tmp_path, clock, 0)
    _run_steps(ledger, clock, 0, 12, step_s=1.0, blocking=0.6)  # last heartbeat at step 12
    # rank 1 hangs during step 13; its watchdog notes it 8 s later; the process ends without a ledger write
    clock.now += 8.0
    write_fault_note(
        tmp_path,
        FaultNote(kind="hang", rank=1, attempt=0, step=12, detected_at=clock.now, section="step", detection_s=8.0),
    )
    clock.now += 1.0
    write_fault_note(tmp_path, FaultNote(kind="exception", rank=0, attempt=0, step=12, detected_at=clock.now))
    clock.now += 5.0  # relaunch
    ledger = _attempt(tmp_path, clock, 1)
    assert not list((tmp_path / "faults").iterdir())  # consumed into the ledger
    _run_steps(ledger, clock, 10, 20, step_s=1.0, blocking=0.4)  # resumed from step 10
    ledger.end_attempt("finished")

    first, second = ledger.attempts
    assert first.end_reason == "hang" and [f["kind"] for f in first.faults] == ["hang", "exception"]
    assert second.end_reason == "finished" and second.restart_count == 1
    r = ledger.report()
    assert r.attempts == 2 and r.restarts == 1 and r.causes == ["hang"]
    assert r.wall_s == pytest.approx(clock.now - t0)
    assert r.training_s == pytest.approx(12.0 + 10.0)
    assert r.startup_s == pytest.approx(0.5)
    # last heartbeat (step 12) to the first step of the next attempt: 8 + 1 + 5 + 0.5 set-up
    assert r.restart_gap_s == pytest.approx(14.5)
    assert r.detection_s == pytest.approx(8.0)
    assert r.recomputed_steps == 2 and r.recompute_s == pytest.approx(2.0)
    assert r.checkpoint_blocking_s == pytest.approx(1.0)
    assert r.productive_s == pytest.approx(22.0 - 2.0 - 1.0)
    assert r.ettr == pytest.approx(19.0 / r.wall_s)
    # the parts add up to the wall time
    assert r.startup_s + r.training_s + r.restart_gap_s == pytest.approx(r.wall_s)


def test_attempt_without_any_note_is_lost_and_preemption_is_not_a_loss(tmp_path: Path) -> None:
    clock = WallClock()
    ledger = _attempt(tmp_path, clock, 0)
    _run_steps(ledger, clock, 0, 5, step_s=1.0, blocking=0.0)  # then SIGKILL: no note, no end
    ledger = _attempt(tmp_path, clock, 1)
    _run_steps(ledger, clock, 5, 8, step_s=1.0, blocking=0.0)
    note = FaultNote(kind="preemption", rank=0, attempt=1, step=8, detected_at=clock.now)
    ledger.end_attempt("preempted", note)
    ledger = _attempt(tmp_path, clock, 0)  # a requeue: the restart count starts over, the ledger does not
    _run_steps(ledger, clock, 8, 9, step_s=1.0, blocking=0.0)
    ledger.end_attempt("finished")
    r = ledger.report()
    assert r.causes == ["lost", "preempted"] and r.recomputed_steps == 0
    assert [a.index for a in ledger.attempts] == [0, 1, 2]
    assert [a.restart_count for a in ledger.attempts] == [0, 1, 0]


def test_heartbeat_writes_are_throttled_but_in_memory_state_is_current(tmp_path: Path) -> None:
    clock = WallClock()
    ledger = EttrLedger(tmp_path, wall_clock=clock, interval_s=10.0)
    ledger.begin_attempt(restart_count=0, launcher="none", world_size=1, job_id=None)
    ledger.first_step(0)
    clock.now += 1.0
    assert ledger.heartbeat(1) is False  # within the interval: not written
    on_disk = json.loads((tmp_path / LEDGER_FILE).read_text())["attempts"][0]
    assert on_disk["last_step"] == 0 and ledger.attempts[0].last_step == 1
    clock.now += 10.0
    assert ledger.heartbeat(2) is True
    assert json.loads((tmp_path / LEDGER_FILE).read_text())["attempts"][0]["last_step"] == 2


def test_unreadable_ledger_is_kept_aside_and_a_new_one_started(tmp_path: Path) -> None:
    (tmp_path / LEDGER_FILE).write_text("{not json")
    ledger = EttrLedger(tmp_path, wall_clock=WallClock())
    assert ledger.attempts == [] and (tmp_path / "ft_ledger.broken").exists()


def test_atomic_write_leaves_no_temporary(tmp_path: Path) -> None:
    atomic_write_json(tmp_path / "x.json", {"a": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_empty_account() -> None:
    r = account([])
    assert r.ettr is None and r.attempts == 0


def test_current_attempt_reads_the_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("FT_RANK_MONITOR_IPC_SOCKET", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    assert current_attempt(0, 1).launcher == "none"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r1")
    a = current_attempt(1, 2)
    assert (a.launcher, a.restart_count, a.job_id, a.rank) == ("torchrun", 2, "r1", 1)
    monkeypatch.setenv("FT_RANK_MONITOR_IPC_SOCKET", "/tmp/x.socket")
    assert current_attempt().launcher == "ft_launcher"


def test_in_process_rollbacks_count_as_recomputation_of_their_attempt(tmp_path: Path) -> None:
    clock = WallClock()
    ledger = _attempt(tmp_path, clock, 0)
    _run_steps(ledger, clock, 0, 8, step_s=1.0, blocking=0.0)
    ledger.note_rollback(2)  # at step 8, back to step 6: steps 7 and 8 are trained again
    for step in range(7, 13):
        clock.now += 1.0
        ledger.heartbeat(step)
    ledger.end_attempt("finished")
    [record] = EttrLedger(tmp_path).attempts  # survives in the file
    assert record.rolled_back_steps == 2 and record.steps == 12 and record.step_s == pytest.approx(1.0)
    r = ledger.report()
    assert r.recomputed_steps == 2 and r.recompute_s == pytest.approx(2.0)
    assert r.productive_s == pytest.approx(r.training_s - 2.0)
