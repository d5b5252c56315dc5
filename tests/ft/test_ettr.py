"""The ETTR ledger: attempts survive restarts (a new ledger object per attempt, as a new process would make), fault
notes left by ranks become the cause of an attempt's end, and the time accounting adds up."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from lightning_resilience.ft.ettr import LEDGER_FILE, EttrLedger, account
from lightning_resilience.ft.restart import FaultNote, atomic_write_json, current_attempt, write_fault_note
from lightning_resilience.ft.restart_cost import describe_restart, process_started_at


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


def test_one_ledger_object_across_attempts_writes_what_each_attempt_became(tmp_path: Path) -> None:
    """Attempts that have ended are encoded once (a heartbeat write costs the current attempt only); the attempt a
    new one closes is written again with the notes its ranks left and its end."""
    clock = WallClock()
    ledger = _attempt(tmp_path, clock, 0)
    _run_steps(ledger, clock, 0, 20, 1.0, 0.1)
    write_fault_note(tmp_path, FaultNote("hang", rank=1, attempt=0, step=20, detected_at=clock.now, message="stuck"))
    clock.now += 5.0
    ledger.begin_attempt(restart_count=1, launcher="torchrun", world_size=2, job_id="j")
    _run_steps(ledger, clock, 20, 30, 1.0, 0.1)
    ledger.begin_attempt(restart_count=2, launcher="torchrun", world_size=2, job_id="j")
    _run_steps(ledger, clock, 30, 35, 1.0, 0.1)
    on_disk = EttrLedger(tmp_path, wall_clock=clock).attempts
    assert [asdict(a) for a in on_disk] == [asdict(a) for a in ledger.attempts]
    assert [a.end_reason for a in on_disk] == ["hang", "lost", None] and on_disk[2].last_step == 35
    assert "\n" not in (tmp_path / LEDGER_FILE).read_text()  # compact: the C encoder writes it


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


def test_each_restart_names_its_steps_lost_and_where_every_second_went(tmp_path: Path) -> None:
    """Fault to first good step, in parts that add up: detection (the attempt's end recorded after its last step),
    relaunch, imports, rendezvous, setup, restore, first step."""
    clock = WallClock()
    ledger = _attempt(tmp_path, clock, 0)
    _run_steps(ledger, clock, 0, 47, step_s=0.1, blocking=0.0)
    fault = clock.now
    clock.now += 1.5  # the peers' collective fails
    ledger.end_attempt("exception", FaultNote(kind="exception", rank=0, attempt=0, step=47, detected_at=clock.now))
    clock.now += 2.0  # teardown, the launcher, new processes
    process = clock.now
    clock.now += 3.0  # imports
    ready = clock.now
    clock.now += 1.0  # rendezvous, process group
    ledger = EttrLedger(tmp_path, wall_clock=clock, interval_s=0.0)
    ledger.begin_attempt(restart_count=1, launcher="torchrun", world_size=2, job_id="j",
                         process_started_at=process, script_ready_at=ready)  # fmt: skip
    clock.now += 0.25  # setup before the restore
    clock.now += 0.05  # the restore
    restored_at = clock.now
    clock.now += 0.2  # data loaders
    ledger.first_step(47, restored_step=47, restored_from="memory", restore_s=0.05, restored_at=restored_at)
    clock.now += 0.3
    ledger.first_step_done()
    ledger.heartbeat(48)
    (cost,) = ledger.report().restart_costs
    assert (cost.attempt, cost.cause, cost.steps_lost, cost.restored_from) == (1, "exception", 0, "memory")
    expected = {"detection": 1.5, "relaunch": 2.0, "imports": 3.0, "rendezvous": 1.0, "setup": 0.45,
                "restore": 0.05, "first_step": 0.3}  # fmt: skip
    assert cost.parts == pytest.approx(expected)
    assert cost.fault_to_first_good_step_s == pytest.approx(clock.now - fault) == pytest.approx(sum(expected.values()))
    assert cost.share("imports") == pytest.approx(3.0 / 8.3)
    line = describe_restart(asdict(cost))
    assert "0 steps lost, resumed from 'memory'" in line and "imports 3.00s (36%)" in line


def test_a_restart_without_the_new_moments_folds_them_into_the_next_part(tmp_path: Path) -> None:
    """A ledger of an older version (no process start, no restore end): the parts still add up, with the unknown
    moments inside their neighbours, and the steps lost are counted."""
    clock = WallClock()
    ledger = _attempt(tmp_path, clock, 0)
    _run_steps(ledger, clock, 0, 12, step_s=1.0, blocking=0.0)
    fault = clock.now
    clock.now += 6.0
    ledger = _attempt(tmp_path, clock, 1)
    _run_steps(ledger, clock, 10, 14, step_s=1.0, blocking=0.0)
    (cost,) = ledger.report().restart_costs
    assert cost.steps_lost == 2
    assert cost.parts["relaunch"] == 0.0 and cost.parts["detection"] == 0.0
    assert cost.parts["rendezvous"] == pytest.approx(6.0)  # the ledger's first entry is the only mark of the gap
    assert cost.fault_to_first_good_step_s == pytest.approx(6.5) == pytest.approx(clock.now - 4.0 - fault)


def test_process_start_time_is_before_now() -> None:
    import time

    started = process_started_at()
    assert started is not None and started <= time.time() + 0.01
