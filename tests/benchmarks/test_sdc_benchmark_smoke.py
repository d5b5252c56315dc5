"""Smoke test of the SDC coverage benchmark: a tiny run at shortened cadences ends with sane JSON (no timing
assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.sdc_coverage import render_markdown, wilson

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_wilson_interval() -> None:
    assert wilson(0, 0) is None
    lo, hi = wilson(20, 20) or (0.0, 0.0)
    assert 0.83 < lo < 0.84 and hi == 1.0  # 20 of 20: the interval still admits 16% misses
    lo, hi = wilson(10, 20) or (0.0, 0.0)
    assert lo < 0.5 < hi


@pytest.mark.timeout(600)
def test_sdc_benchmark_quick_run_reports_kinds_of_fault_apart(tmp_path: Path) -> None:
    """Every cell's outcomes add up, a persistent state flip is caught at the reconciliation, a faulty device is
    named after the rollback its non-finite values ask for, a stale save is refused, the overhead is measured
    against the plain arm on the trials' ranks and again on one rank per core, and the section renders."""
    out = tmp_path / "sdc.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "benchmarks.sdc_coverage", "--quick", "--preset", "default", "--locations", "param",
        "--faulty", "exponent_every_step", "--out", str(out), "--tmpdir", str(tmp_path), "--allow-loaded",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    preset = result["presets"]["default"]
    assert preset["config"]["guard_read_lag"] == 1 and preset["config"]["ddp_fingerprint"] is False
    cells = preset["cells"]
    assert set(cells) == {"param/one_bit", "param/burst3", "param/strided4", "faulty/exponent_every_step"}
    for cell in cells.values():
        assert cell["caught"] + cell["flagged"] + cell["missed"] + cell["no_effect"] == cell["trials"] == 1
    assert set(preset["kinds"]) == {"persistent", "faulty_device"}
    assert preset["clean_run_events"] == []
    for key, ranks in (("overhead", 3), ("overhead_own_cores", 2)):  # the trials' ranks, then one rank per core
        overhead = preset[key]
        assert overhead["ranks"] == ranks and len(overhead["driver_phases_ms_per_step"]) == ranks
        assert overhead["steps_each"] > 0 and len(overhead["samples_s"]["plain"]) == overhead["steps_each"]
        assert overhead["driver_phases_ms_per_step"][0]["begin"] > 0
    assert result["stale_saves"]["refused"] == result["stale_saves"]["trials"] == 2
    assert {t["verdict"] for t in result["targets"]} <= {"PASS", "MISS"}
    assert "Preset `default`" in proc.stdout and "kind of fault" in render_markdown(result)
