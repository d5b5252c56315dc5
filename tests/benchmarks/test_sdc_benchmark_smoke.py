"""Smoke test of the SDC coverage benchmark: a tiny run ends with sane JSON (no timing assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_sdc_benchmark_quick_run_writes_coverage(tmp_path: Path) -> None:
    """Every location x bit class cell is tried, outcomes add up, and each mechanism has an overhead figure."""
    out = tmp_path / "sdc.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "benchmarks.sdc_coverage", "--quick", "--flips-per-cell", "1", "--faulty-trials", "1",
        "--overhead-steps", "3", "--replay-reps", "2", "--batch-size", "4",
        "--out", str(out), "--tmpdir", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    cells = result["coverage"]["cells"]
    assert len(cells) == 17  # 4 locations x 4 bit classes + the faulty device
    for cell in cells.values():
        assert cell["caught"] + cell["mislocated"] + cell["missed"] + cell["no_effect"] == cell["trials"] == 1
    # sign and exponent flips always change the state: the checks that ran every step must have named the rank
    for key in ("grad/sign", "param/exponent", "optim/sign", "faulty_device"):
        assert cells[key]["caught"] == 1, (key, cells[key])
    overhead = result["overhead"]["overhead_pct"]
    assert set(overhead) >= {"guards", "dual_run", "ddp_fingerprint", "reconcile"}
    assert all(v > 0 for v in overhead.values())
    assert {t["verdict"] for t in result["targets"]} <= {"PASS", "MISS"}
