"""Smoke test of the scale benchmark: a quick run on 2 ranks ends with sane JSON and renders (no timing assertions:
the figures depend on the shared machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_scale_benchmark_measures_the_suite_per_step_and_predicts_at_scale(tmp_path: Path) -> None:
    from benchmarks.scale import PREDICT_AT, readme_summary, render_markdown

    out = tmp_path / "scale.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.scale", "--quick", "--ranks", "2", "--allow-loaded", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    (row,) = r["rows"]
    assert row["ranks"] == 2 and row["suite_ms"]["n"] > 0
    # the suite's time on the training thread was measured: wall time at least its CPU time, both positive
    assert 0 < row["suite_cpu_ms"]["mean"] <= row["suite_ms"]["mean"] * 1.05
    assert row["rounds"] > 0 and row["fds_per_rank"]["with"] > row["fds_per_rank"]["without"]
    assert {p["ranks"] for p in r["model"]["predictions"]} == set(PREDICT_AT)
    assert all(p["round_ms"] > 0 for p in r["model"]["predictions"])
    # the reference work was timed on the same thread: the suite's CPU time in its units
    assert row["reference_cpu_ms"]["median"] > 0 and row["suite_cpu_in_reference"]["median"] > 0
    # how often the scheduler took the training thread's core inside the suite's hooks: counted, never negative
    assert row["suite_preempted"]["mean"] >= 0 and "suite preempted/step" in render_markdown(r)
    assert len(r["targets"]) == 8 and "load" in r["machine"]
    assert "suite CPU ms/step" in render_markdown(r) and readme_summary(r).startswith("**scale**")
