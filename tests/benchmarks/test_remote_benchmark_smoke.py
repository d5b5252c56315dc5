"""Smoke test of the remote-tier benchmark: a quick run against a loopback S3 server ends with sane JSON.

No timing assertions: only that every figure was measured (positive) and the report renders.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("moto.server", reason="the remote benchmark needs `pip install 'moto[server]' s3fs`")
pytest.importorskip("s3fs")


def test_remote_benchmark_quick_run_writes_figures(tmp_path: Path) -> None:
    out = tmp_path / "remote.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.remote_tier", "--quick", "--out", str(out), "--tmpdir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())

    for key in ("benchmark", "command", "date", "machine", "versions", "config", "write", "restore", "ratios"):
        assert key in result, key
    assert result["benchmark"] == "remote_tier"
    assert "--quick" in result["command"]
    assert result["config"]["preset"] == "tiny"
    reps = result["config"]["reps"]
    assert reps >= 3

    for key in ("memory", "local", "local_cold", "remote"):
        entry = result["restore"][key]
        assert entry["n"] == reps, key
        assert entry["median_s"] > 0, key
    for key in ("local_tier_write", "remote_tier_write", "raw_s3fs_put", "raw_s3fs_get"):
        entry = result["write"][key]
        assert entry["bytes"] > 0, key
        assert entry["time"]["n"] == reps, key
        assert entry["time"]["median_s"] > 0, key
        assert entry["throughput_Bps"] > 0, key
    # the raw baseline moves exactly as many bytes as the tier's shard
    assert result["write"]["raw_s3fs_put"]["bytes"] == result["write"]["remote_tier_write"]["bytes"]
    assert result["write"]["remote_tier_write"]["bytes"] >= result["write"]["tensor_bytes"] > 0
    for name, value in result["ratios"].items():
        assert value is not None and value > 0, name

    from benchmarks.remote_tier import TITLE, render_markdown

    text = render_markdown(result)
    assert text.startswith(f"## {TITLE}")
    assert "RemoteTier.write" in text
