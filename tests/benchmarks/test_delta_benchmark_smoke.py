"""Smoke test of the delta benchmark: a very short run ends with sane JSON (no timing assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_delta_benchmark_quick_run_writes_ratios(tmp_path: Path) -> None:
    """Full and delta bytes are measured on a real training run, and the ratio is positive."""
    out = tmp_path / "delta.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "benchmarks.delta_checkpoint", "--quick", "--steps", "4", "--full-every", "2",
        "--only", "adamw", "--out", str(out), "--tmpdir", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    text = json.dumps(result)
    assert "adamw" in text
    assert any(isinstance(v, float) and v > 0 for v in _leaves(result))


def _leaves(node: object) -> list[object]:
    if isinstance(node, dict):
        return [x for v in node.values() for x in _leaves(v)]
    if isinstance(node, list):
        return [x for v in node for x in _leaves(v)]
    return [node]
