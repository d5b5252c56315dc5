"""Smoke test of the peer-restore benchmark: a quick two-rank run measures every figure and renders.

No timing assertions: only that every figure was measured (positive), restored states were checked, and the report
renders.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_peer_benchmark_quick_run_writes_figures(tmp_path: Path) -> None:
    out = tmp_path / "peer.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.peer_restore", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["preset"] == "tiny" and result["reps"] == 3
    for name in ("peer_ram", "own_tmpfs", "local_warm", "local_cold", "memory"):
        entry = result["restore"][name]
        assert entry["n"] == 3 and entry["median_s"] > 0, name
    assert result["shard_bytes"] > result["state_bytes"] > 0  # the shard holds the state plus its metadata files
    assert all(v is not None and v > 0 for v in result["ratios"].values())

    from benchmarks.peer_restore import render_markdown

    text = render_markdown(result)
    assert "peer RAM" in text and "| local disk, cold |" in text
