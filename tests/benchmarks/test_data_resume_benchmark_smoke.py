"""Smoke test of the data-resume benchmark: a very short run ends with sane JSON (no timing assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_data_resume_benchmark_quick_run_writes_ratios(tmp_path: Path) -> None:
    """Fresh, index-level resume and fetch-and-discard figures exist for both worker counts, with ratios."""
    out = tmp_path / "data_resume.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.data_resume", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for w in (0, 2):
        assert result["figures"][f"w{w}/fresh"]["median_s"] > 0
        for k in (10, 1_000):
            assert result["ratios"][f"w{w}/resume@{k}"] > 0
            assert result["ratios"][f"w{w}/discard@{k}"] > 0
    assert "resume at batch 1,000" in proc.stdout
