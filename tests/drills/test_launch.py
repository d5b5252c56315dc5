"""Launcher drills: ``lightning-resilience launch`` with the launch line users type (static rendezvous,
``--master-port``), 2 CPU ranks (gloo), real processes, real signals.

* several faults in a row (SIGKILL, a preemption notice, a hang), each restart comes up and the job finishes;
* a job that keeps failing before it commits a newer step stops with ``ExitCode.NO_PROGRESS`` after N attempts;
* a SIGTERM to the launcher (a scheduler's preemption) saves, exits 87, and the relaunch continues;
* plain ``torchrun --master-port --max-restarts`` (no launcher): ``ResilientDDPStrategy``'s restart comes up.

``make launch-drills`` repeats random fault sequences (``LAUNCH_CAMPAIGN=N``) for the statistics in
docs/launching.md.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_resilience.attribution.failures import peer_symptom
from lightning_resilience.exit_codes import ExitCode
from lightning_resilience.launch.records import AttemptRecord, read_records
from tests._ranks import free_port
from tests.ft.test_ft_drills import _reports

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "drills" / "_launch_script.py"
STEPS = 24
WORLD_SIZE = 2
ATTEMPT_TIMEOUT_S = 120  # one attempt on a loaded 2-core machine takes 10-40 s
CAMPAIGN = int(os.environ.get("LAUNCH_CAMPAIGN", "0"))
CAMPAIGN_SEED = int(os.environ.get("DRILL_SEED", "20241130"))

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("LIGHTNING_RESILIENCE", "LIGHTNING_RESILIENCE_ATTEMPT", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        env.pop(name, None)
    return env


def _launcher() -> list[str]:
    console = Path(sys.executable).parent / "lightning-resilience"  # the installed command, as users run it
    return [str(console)] if console.exists() else [sys.executable, "-m", "lightning_resilience.cli"]


def _launch_cmd(run_dir: Path, *script_args: str, launcher_args: tuple[str, ...] = ()) -> list[str]:
    return [
        *_launcher(), "launch", "--nproc-per-node", str(WORLD_SIZE), "--max-restarts", "5",
        "--master-port", str(free_port()), "--run-dir", str(run_dir), *launcher_args,
        str(SCRIPT), "--run-dir", str(run_dir), "--steps", str(STEPS), *script_args,
    ]  # fmt: skip


def _launch(run_dir: Path, *script_args: str, attempts: int, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        _launch_cmd(run_dir, *script_args, **kwargs),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=ATTEMPT_TIMEOUT_S * attempts,
    )
    (run_dir / "launcher.log").write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    return proc


def _attempts(run_dir: Path) -> list[AttemptRecord]:
    return [r for r in read_records(run_dir / "launch") if isinstance(r, AttemptRecord)]


def _check_came_up(run_dir: Path, records: list[AttemptRecord]) -> None:
    """Every attempt after the first came up on every rank and resumed from the newest committed step."""
    reports = _reports(run_dir)
    for record in records[1:]:
        started = [reports.get((record.attempt, r)) for r in range(WORLD_SIZE)]
        assert all(s is not None and "start_step" in s for s in started), (record.attempt, started)
        assert {s["restored_step"] for s in started if s} == {record.step_at_start}, (record.attempt, started)


def test_kill_preemption_and_hang_in_a_row_all_restarts_come_up(tmp_path: Path) -> None:
    faults = ("--fault", "0:sigkill:1:7", "--fault", "1:sigterm:0:13", "--fault", "2:hang:1:17")
    proc = _launch(tmp_path, *faults, attempts=4)
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = _attempts(tmp_path)
    assert [r.attempt for r in records] == [0, 1, 2, 3]
    assert [r.decision for r in records] == ["restart", "restart", "restart", "done"]
    assert records[-1].outcome == "succeeded" and records[-1].exit_code == 0
    _check_came_up(tmp_path, records)
    assert all(r.get("final_step") == STEPS for k, r in _reports(tmp_path).items() if k[0] == 3)

    killed, preempted, hung = records[:3]
    # attempt 0: rank 1 SIGKILLed is the cause; rank 0, whose all-reduce lost its peer, is its victim
    assert killed.cause is not None and (killed.cause.rank, killed.cause.kind, killed.cause.detail) == (
        1,
        "signal",
        "SIGKILL",
    )
    victim = next(r for r in killed.ranks if r.rank == 0)
    assert victim.role == "victim" and victim.exception is not None, victim
    assert peer_symptom(victim.exception["message"]) is not None, victim  # its collective lost the killed peer
    # attempt 1: rank 0 got the notice, both ranks agreed on a step, saved it and exited 87
    assert preempted.cause is not None and (preempted.cause.rank, preempted.cause.detail) == (0, "preempted")
    assert [r.exit_code for r in preempted.ranks] == [int(ExitCode.PREEMPTED)] * WORLD_SIZE
    assert any(n["kind"] == "preemption" and n["rank"] == 0 for n in preempted.fault_notes)
    assert preempted.progress and hung.step_at_start == preempted.step_at_end
    # attempt 2: the watchdog ended the hang (86); the stack dumps are collected with the attempt
    assert hung.cause is not None and (hung.cause.kind, hung.cause.detail) == ("verdict", "hang")
    assert any(r.exit_code == int(ExitCode.HANG) for r in hung.ranks)
    dumps = {Path(p).name: Path(p).read_text() for p in hung.hang_dumps}
    assert "stacks_rank1.txt" in dumps and "on_train_batch_start" in dumps["stacks_rank1.txt"]  # the spinning frame
    assert all(Path(p).parent == tmp_path / "launch" / "attempt_0002" for p in hung.hang_dumps)
    assert "cause: rank 1 killed by SIGKILL" in proc.stderr  # said as it happens, one line per attempt


def test_a_job_that_cannot_progress_stops_with_no_progress(tmp_path: Path) -> None:
    # rank 1 dies at step 6 on every attempt (a node that OOMs there): step 4 is committed once, never a newer one
    proc = _launch(tmp_path, "--fault", "*:sigkill:1:6", attempts=3, launcher_args=("--max-no-progress-restarts", "2"))
    assert proc.returncode == ExitCode.NO_PROGRESS, proc.stderr[-6000:]
    records = _attempts(tmp_path)
    assert [(r.step_at_start, r.step_at_end, r.progress) for r in records] == [
        (None, 4, True),
        (4, 4, False),
        (4, 4, False),
    ]
    assert [r.no_progress_count for r in records] == [0, 1, 2]
    assert [r.decision for r in records] == ["restart", "restart", "stop"]
    assert records[-1].exit_code == ExitCode.NO_PROGRESS and "do not requeue" in records[-1].reason
    for record in records:
        assert record.cause is not None and (record.cause.rank, record.cause.detail) == (1, "SIGKILL")
    _check_came_up(tmp_path, records)


def _wait_for(path: Path, deadline_s: float, proc: subprocess.Popen[str]) -> None:
    end = time.monotonic() + deadline_s
    while not path.exists():
        assert proc.poll() is None, "the launcher ended before training started"
        assert time.monotonic() < end, f"{path} did not appear within {deadline_s} s"
        time.sleep(0.2)


def test_sigterm_to_the_launcher_saves_exits_for_a_requeue_and_the_relaunch_continues(tmp_path: Path) -> None:
    cmd = _launch_cmd(tmp_path, "--step-time", "0.25")
    with subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            _wait_for(tmp_path / "reports" / "attempt0_rank1.json", ATTEMPT_TIMEOUT_S, proc)  # rank 1 is training
            proc.send_signal(signal.SIGTERM)  # what Slurm (scancel, preemption) and Kubernetes send
            _, stderr = proc.communicate(timeout=ATTEMPT_TIMEOUT_S)
        finally:
            proc.kill()
    assert proc.returncode == ExitCode.PREEMPTED, stderr[-6000:]
    (first,) = _attempts(tmp_path)
    assert first.outcome == "interrupted" and first.decision == "stop" and first.exit_code == ExitCode.PREEMPTED
    saved = {r["preempted_at"] for k, r in _reports(tmp_path).items() if k[0] == 0}
    assert len(saved) == 1 and None not in saved, _reports(tmp_path)  # both ranks stopped at one agreed step
    assert [r.exit_code for r in first.ranks] == [int(ExitCode.PREEMPTED)] * WORLD_SIZE
    assert first.step_at_end == saved.pop()  # the agreed step was saved and counts as committed

    relaunch = _launch(tmp_path, attempts=1)  # the scheduler's requeue: the same command, the same run directory
    assert relaunch.returncode == 0, relaunch.stderr[-6000:]
    records = _attempts(tmp_path)
    assert [r.attempt for r in records] == [0, 1]  # the numbering continues across the requeue
    assert records[1].step_at_start == first.step_at_end and records[1].outcome == "succeeded"
    _check_came_up(tmp_path, records)


def _torchrun_static(run_dir: Path, *script_args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD_SIZE), "--max-restarts", "2",
        "--master-port", str(free_port()), str(SCRIPT), "--run-dir", str(run_dir), "--steps", str(STEPS),
        *script_args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=ATTEMPT_TIMEOUT_S * 2)
    (run_dir / "torchrun.log").write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    return proc


def test_plain_torchrun_static_rendezvous_restart_comes_up_with_resilient_ddp(tmp_path: Path) -> None:
    # without the attempt-scoped store, most such restarts hang or fail in init_process_group (docs/launching.md)
    proc = _torchrun_static(tmp_path, "--fault", "0:sigkill:1:7")
    assert proc.returncode == 0, proc.stderr[-6000:]
    reports = _reports(tmp_path)
    assert sorted(reports) == [(a, r) for a in (0, 1) for r in range(WORLD_SIZE)]  # one restart, and it came up
    assert [reports[(1, r)]["final_step"] for r in range(WORLD_SIZE)] == [STEPS] * WORLD_SIZE
    assert "Connection refused" not in proc.stderr


@pytest.mark.skipif(not CAMPAIGN, reason="a campaign: make launch-drills (LAUNCH_CAMPAIGN=N)")
@pytest.mark.parametrize("run", range(CAMPAIGN))
def test_campaign_random_fault_sequences(tmp_path: Path, run: int) -> None:
    rng = random.Random(CAMPAIGN_SEED + run)
    faults: list[str] = []
    step = 3
    for attempt in range(3):
        step = rng.randint(step + 2, step + 5)
        kind = rng.choice(("sigkill", "sigterm", "exception"))
        faults += ["--fault", f"{attempt}:{kind}:{rng.randint(0, 1)}:{step}"]
    print(f"campaign run {run}: {' '.join(faults)}")
    proc = _launch(tmp_path, *faults, attempts=4)
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = _attempts(tmp_path)
    assert len(records) == 4 and records[-1].outcome == "succeeded"
    _check_came_up(tmp_path, records)
