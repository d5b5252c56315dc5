"""Smoke test of the fault-recovery benchmark: ``--quick`` runs its torchrun drills end to end and writes sane JSON.

No timing assertions beyond what the benchmark itself defines: the figures depend on the (shared) machine.
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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "ft_recovery.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.ft_recovery", "--quick", "--out", str(out), "--tmpdir", str(tmp)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "| target |" in proc.stdout
    return json.loads(out.read_text())


def test_structure_and_reference(quick_result: dict) -> None:
    for key in ("benchmark", "command", "date", "machine", "config", "reference", "faults", "ratios", "targets"):
        assert key in quick_result, key
    assert quick_result["benchmark"] == "ft_recovery"
    assert quick_result["command"].startswith("python -m benchmarks.ft_recovery")
    assert quick_result["config"]["quick"] is True
    assert _positive(quick_result["reference"]["cold_start_s"]) and _positive(quick_result["reference"]["step_s"])


def test_fault_figures(quick_result: dict) -> None:
    faults = quick_result["faults"]
    assert sorted(faults) == ["hang-loop", "sigterm"]
    hang, preempt = faults["hang-loop"], faults["sigterm"]
    assert hang["end_reason"] == "hang" and 86 in hang["exit_codes"]
    assert hang["detection_s"] >= hang["timeout_s"] >= quick_result["config"]["min_timeout_s"]
    assert preempt["end_reason"] == "preempted" and 87 in preempt["exit_codes"]
    assert preempt["recomputed_steps"] == 0 and preempt["detection_s"] >= 0
    for f in faults.values():
        assert _positive(f["restart_s"]) and _positive(f["restart_gap_s"]) and 0 < f["ettr"] < 1
        assert f["lost_s"] >= f["restart_gap_s"]


def test_ratios_targets_and_markdown(quick_result: dict) -> None:
    assert _positive(quick_result["ratios"]["default_timeout_over_hang_detection"])
    assert _positive(quick_result["ratios"]["restart_over_cold_start"])
    assert len(quick_result["targets"]) == 3
    assert {t["verdict"] for t in quick_result["targets"]} <= {"PASS", "MISS"}
    from benchmarks.ft_recovery import render_markdown

    text = render_markdown(quick_result)
    assert quick_result["command"] in text and "| fault |" in text
