"""Smoke test of the SDC coverage benchmark: a tiny run at shortened cadences ends with sane JSON (no timing
assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_sdc_benchmark_quick_run_writes_coverage(tmp_path: Path) -> None:
    """Every tried cell's outcomes add up, a persistent state flip is caught at the reconciliation, the overhead is
    measured, and the section renders."""
    out = tmp_path / "sdc.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "benchmarks.sdc_coverage", "--quick", "--preset", "default", "--locations", "param",
        "optim", "--faulty-trials", "1", "--out", str(out), "--tmpdir", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    preset = result["presets"]["default"]
    assert preset["config"]["guard_read_lag"] == 1 and preset["trial_steps"] == 2 * preset["window_steps"]
    cells = preset["cells"]
    assert len(cells) == 9  # 2 locations x 4 bit classes + the faulty device
    for cell in cells.values():
        assert cell["caught"] + cell["flagged"] + cell["missed"] + cell["no_effect"] == cell["trials"] == 1
    # a sign flip in stored state persists until the reconciliation, which names the rank
    for key in ("param/sign", "optim/sign"):
        assert cells[key]["caught"] == 1, (key, cells[key])
    assert preset["clean_run_events"] == []
    assert preset["overhead"]["steps_each"] > 0 and isinstance(preset["overhead"]["slowdown_mean"], float)
    assert {t["verdict"] for t in result["targets"]} <= {"PASS", "MISS"}
    assert "Preset `default`" in proc.stdout
