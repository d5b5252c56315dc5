"""Fault-tolerance drills under ``torchrun --max-restarts``: one fault each, detected within its bound, recorded in the
ledger, resumed automatically, and finished with exactly the weights of an uninterrupted run.

Each drill runs ``tests/ft/_ft_script.py`` on 2 CPU ranks (gloo). Faults: an exception, a SIGKILL, a rank spinning in a
Python loop, a rank stuck in a collective, and a SIGTERM preemption notice at a seeded random step.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilience.exit_codes import ExitCode
from tests._ranks import free_port

HANG_EXIT_CODE, PREEMPT_EXIT_CODE = int(ExitCode.HANG), int(ExitCode.PREEMPTED)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "ft" / "_ft_script.py"
STEPS = 16
WORLD_SIZE = 2
MIN_TIMEOUT_S = 4.0  # the script's floor on calibrated timeouts: a hang is detected ~4 s after it starts
DETECTION_SLACK_S = 5.0  # watchdog wake-up on a loaded machine, on top of the timeout itself
TORCHRUN_TIMEOUT_S = 150
DRILL_SEED = int(os.environ.get("DRILL_SEED", "20241130"))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 30)]


def _torchrun(
    run_dir: Path, *args: str, launcher: tuple[str, ...] = (sys.executable, "-m", "torch.distributed.run")
) -> subprocess.CompletedProcess[str]:
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        *launcher, "--nproc-per-node", str(WORLD_SIZE), "--max-restarts", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(SCRIPT),
        "--run-dir", str(run_dir), "--steps", str(STEPS), *args,
    ]  # fmt: skip
    if "--min-timeout" not in args:
        cmd += ["--min-timeout", str(MIN_TIMEOUT_S)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # see tests/drills/test_torchrun_kill.py (pytorch#135712)
    }
    env.pop("FT_RANK_MONITOR_IPC_SOCKET", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S)
    (run_dir / "torchrun.log").write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    assert proc.returncode == 0, f"torchrun failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}"
    return proc


def _reports(run_dir: Path) -> dict[tuple[int, int], dict[str, Any]]:
    out = {}
    for path in (run_dir / "reports").glob("attempt*_rank*.json"):
        report = json.loads(path.read_text())
        out[(report["attempt"], report["rank"])] = report
    return out


def _ledger(run_dir: Path) -> list[dict[str, Any]]:
    return json.loads((run_dir / "ft" / "ft_ledger.json").read_text())["attempts"]


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from the uninterrupted run"


def _check_resumed(run_dir: Path, reference: dict[str, torch.Tensor]) -> tuple[dict, list[dict[str, Any]]]:
    """Invariants of every drill: one restart that resumed on its own and finished bitwise exact."""
    reports = _reports(run_dir)
    assert sorted(reports) == [(a, r) for a in (0, 1) for r in range(WORLD_SIZE)], sorted(reports)
    resumed = [reports[(1, r)] for r in range(WORLD_SIZE)]
    assert [r["final_step"] for r in resumed] == [STEPS] * WORLD_SIZE
    restored = resumed[0]["restored_step"]
    assert all(r["restored_step"] == restored == r["start_step"] for r in resumed)
    assert restored is not None and restored > 0
    # the calibration travelled with the checkpoint: the restarted attempt starts calibrated
    assert all(r["calibrated_at_start"] and r["timeouts_at_start"]["step"] <= 60.0 for r in resumed)
    _assert_bitwise_equal(torch.load(run_dir / "weights.pt", weights_only=True), reference)
    ledger = _ledger(run_dir)
    assert [a["restart_count"] for a in ledger] == [0, 1]
    assert ledger[1]["end_reason"] == "finished" and ledger[1]["start_step"] == restored
    ettr = resumed[0]["ft"]["ettr"]
    assert ettr["restarts"] == 1 and 0 < ettr["ettr"] < 1 and ettr["restart_gap_s"] > 0
    assert ettr["recomputed_steps"] == max(ledger[0]["last_step"] - restored, 0)
    return reports, ledger


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    run_dir = tmp_path_factory.mktemp("ft_reference")
    _torchrun(run_dir)
    reports = _reports(run_dir)
    assert sorted(reports) == [(0, r) for r in range(WORLD_SIZE)]
    assert all(r["restored_step"] is None and r["final_step"] == STEPS for r in reports.values())
    (attempt,) = _ledger(run_dir)
    assert attempt["end_reason"] == "finished" and attempt["faults"] == []
    assert not (run_dir / "ft" / "stacks").exists()  # no false hang on an uninterrupted run
    return torch.load(run_dir / "weights.pt", weights_only=True)


def _notes(ledger: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [f for f in ledger[0]["faults"] if f["kind"] == kind]


def test_exception_on_one_rank_is_recorded_and_resumed(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    _torchrun(tmp_path, "--fault", "exception", "--fault-step", "9", "--fault-rank", "1")
    _, ledger = _check_resumed(tmp_path, reference)
    assert ledger[0]["end_reason"] == "exception"
    (note,) = [n for n in _notes(ledger, "exception") if n["rank"] == 1]
    assert "injected exception at step 9" in note["message"] and note["step"] == 9


def test_sigkill_leaves_no_note_from_the_killed_rank(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    _torchrun(tmp_path, "--fault", "sigkill", "--fault-step", "8", "--fault-rank", "1")
    _, ledger = _check_resumed(tmp_path, reference)
    assert [n for n in ledger[0]["faults"] if n["rank"] == 1] == []  # died without notice
    assert ledger[0]["end_reason"] in ("lost", "exception")  # the survivor may note its broken collective


@pytest.mark.parametrize(
    ("fault", "marker"), [("hang-loop", "_spin_forever"), ("hang-collective", "_stuck_in_collective")]
)
def test_hang_is_detected_within_its_bound_with_stack_dumps(
    tmp_path: Path, reference: dict[str, torch.Tensor], fault: str, marker: str
) -> None:
    proc = _torchrun(tmp_path, "--fault", fault, "--fault-step", "9", "--fault-rank", "1")
    assert f"exitcode: {HANG_EXIT_CODE}" in proc.stderr  # the watchdog ended a rank with the hang code
    _, ledger = _check_resumed(tmp_path, reference)
    assert ledger[0]["end_reason"] == "hang"
    hangs = {n["rank"]: n for n in _notes(ledger, "hang")}
    assert 1 in hangs, ledger[0]["faults"]  # the rank that hung detected it itself
    note = hangs[1]
    assert note["section"] == "step" and note["step"] == 9
    assert MIN_TIMEOUT_S <= note["timeout_s"] <= 60.0 and "(calibrated)" in note["message"]
    assert note["timeout_s"] <= note["detection_s"] <= note["timeout_s"] + DETECTION_SLACK_S
    stacks = Path(note["stacks"]).read_text()
    assert marker in stacks and "Thread 0x" in stacks  # every thread of the hung rank, the stuck frame included
    if 0 in hangs:  # the peer, stuck in the step's all-reduce, may have fired too: its dump shows where
        assert "backward" in Path(hangs[0]["stacks"]).read_text()


def test_sigterm_preemption_saves_exits_with_requeue_code_and_resumes_without_loss(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    signal_step = random.Random(DRILL_SEED).randint(4, STEPS - 4)
    print(f"drill: DRILL_SEED={DRILL_SEED} -> SIGTERM to rank 1 at step {signal_step}")
    proc = _torchrun(tmp_path, "--fault", "sigterm", "--fault-step", str(signal_step), "--fault-rank", "1")
    assert f"exitcode: {PREEMPT_EXIT_CODE}" in proc.stderr
    reports, ledger = _check_resumed(tmp_path, reference)
    first = [reports[(0, r)] for r in range(WORLD_SIZE)]
    stop = first[0]["preempted_at"]
    # the signal arrived during step signal_step + 1; both ranks agreed on the boundary after the next one at most
    assert all(r["preempted_at"] == stop and r["exit_code"] == PREEMPT_EXIT_CODE for r in first)
    assert signal_step + 1 <= stop <= signal_step + 2
    assert all(r["emergency_saved"] == stop for r in first)
    assert reports[(1, 0)]["restored_step"] == stop  # nothing recomputed
    assert ledger[0]["end_reason"] == "preempted" and ledger[0]["last_step"] == stop
    (note,) = _notes(ledger, "preemption")
    assert note["rank"] == 1 and "SIGTERM" in note["message"]
    assert reports[(1, 0)]["ft"]["ettr"]["recomputed_steps"] == 0


FT_LAUNCHER = Path(sys.executable).parent / "ft_launcher"


@pytest.mark.skipif(not FT_LAUNCHER.exists(), reason="nvidia-resiliency-ext's ft_launcher is not installed")
def test_ft_launcher_detects_a_hang_from_heartbeats_and_sections_and_restarts_in_job(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    # our watchdog's floor is 60 s here, so the hang is left to NVRx's rank monitor (step section: 6 s)
    nvrx = (
        str(FT_LAUNCHER), "--ft-workload-check-interval", "0.5", "--ft-initial-rank-heartbeat-timeout", "120",
        "--ft-rank-heartbeat-timeout", "20", "--ft-rank-section-timeouts", "setup:120,step:6,checkpointing:60",
        "--ft-rank-out-of-section-timeout", "20",
    )  # fmt: skip
    proc = _torchrun(tmp_path, "--fault", "hang-loop", "--fault-step", "9", "--min-timeout", "60", launcher=nvrx)
    assert "exitcode: -9" in proc.stderr  # the rank monitor SIGKILLed the hung rank
    assert "FT timeout elapsed" in proc.stderr
    reports, ledger = _check_resumed(tmp_path, reference)
    assert all(a["launcher"] == "ft_launcher" for a in ledger)
    assert reports[(1, 0)]["ft"]["nvrx"].startswith("NVRx rank monitor connected")
    assert _notes(ledger, "hang") == [] and not (tmp_path / "ft" / "stacks").exists()  # NVRx acted first
