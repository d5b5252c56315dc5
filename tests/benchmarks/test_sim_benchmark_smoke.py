"""Smoke tests of the simulator benchmarks: the anchors in quick mode, and one tiny fault-injected validation run.

No timing assertions: the figures depend on the (shared) machine. Structure, consistency and sanity are checked.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{module} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def test_sim_anchors_quick(tmp_path: Path) -> None:
    out = tmp_path / "sim_anchors.json"
    proc = _run("benchmarks.sim_anchors", "--quick", "--out", str(out), timeout=180)
    assert "| target |" in proc.stdout
    data = json.loads(out.read_text())
    for key in ("benchmark", "command", "date", "machine", "kokolis_mttf", "kokolis_ettr", "byterobust", "trainmover"):
        assert key in data, key
    # the 1,024-GPU reference is reproduced by the failure draws, and scaling is 1/N
    ref = next(r for r in data["kokolis_mttf"]["rows"] if r["gpus"] == 1024)
    assert abs(ref["gap"]) < 0.05
    # the Kokolis claim: 6.5 failures / 1000 node-days with 300 s checkpoints is the worst of the four cases
    rows = data["kokolis_ettr"]["rows"]
    worst = min(rows, key=lambda r: r["ettr"])
    assert (worst["failures_per_1000_node_days"], worst["checkpoint_s"]) == (6.5, 300.0)
    # Daly: every row has a simulated optimum and an ETTR close to his complete model
    for r in data["daly"]["rows"]:
        assert _finite(r["simulated_optimum_s"]) and r["simulated_optimum_s"] > 0
        assert abs(r["sim_ettr_at_daly"] - r["daly_model_ettr"]) < 0.02
    assert data["speed"]["seconds_median"] > 0 and data["speed"]["failures_mean"] > 1000
    assert 0 < data["byterobust"]["ettr"] < 1
    assert {t["verdict"] for t in data["targets"]} <= {"PASS", "MISS"}


@pytest.mark.slow
@pytest.mark.timeout(540)
def test_sim_validation_one_kill(tmp_path: Path) -> None:
    out = tmp_path / "sim_validation.json"
    run_dir = tmp_path / "run"
    proc = _run(
        "benchmarks.sim_validation",
        # enough steps that the kill, 2 s after the first batch, lands in training even on a fast, idle machine
        "--steps", "120", "--every", "10", "--kill-at", "2", "--replications", "50",
        "--run-dir", str(run_dir), "--out", str(out),
        timeout=480,
    )  # fmt: skip
    assert "ETTR gap" in proc.stdout
    data = json.loads(out.read_text())
    a, b, p = data["calibration_run"], data["validation_run"], data["predicted"]
    assert a["train_seed"] != b["train_seed"] and a["kill_schedule_seed"] != b["kill_schedule_seed"]
    for m in (a, b):
        assert m["kills"] == 1 and m["attempts"] == 2
        assert 0 < m["ettr"] < 1 and m["restart_s"] > 0 and m["step_s"] > 0
    # the replay saw B's single failure and finished the same work
    assert sum(p["replay"]["failures"].values()) == 1
    assert p["replay"]["final_step"] == 120 - 10
    assert 0 < p["replay_ettr"] < 1
    # the prediction used A's costs (through the --from-run file of run A), not B's
    report = json.loads((run_dir / "calibration_run" / "resilience_report.json").read_text())
    assert report["restart_seconds"]["in_job"] == pytest.approx(a["restart_s"])
    assert p["config"]["restart"]["in_job"] == pytest.approx(a["restart_s"])
    assert p["config"]["tiers"][0]["every_n_steps"] == 10
    assert "calibration run A" in proc.stdout and "validation run B" in proc.stdout
