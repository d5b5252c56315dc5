"""The GPU check's flow, on the CPU with a tiny model (``--cpu-smoke``): every part runs and is recorded, the JSON
names the device (none here) and renders. The GPU figures themselves need a CUDA machine (``make gpu-check``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_gpu_check_flow_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--cpu-smoke", "--out", str(out), "--tmpdir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["cpu_smoke"] is True and set(r["parts"]) == {"sync_tests", "slowdown", "overlap", "sdc", "nccl_drills"}
    assert all(p["ok"] for p in r["parts"].values()), {k: p.get("error") for k, p in r["parts"].items()}
    assert r["parts"]["sync_tests"]["passed"]  # skipped without CUDA, and pytest says so
    assert "skipped" in r["parts"]["nccl_drills"]
    assert r["parts"]["slowdown"]["result"]["slowdown"]["ours"]["mean"] is not None
    assert r["parts"]["overlap"]["copy_s"] > 0
    sdc = r["parts"]["sdc"]  # three arms in turn, the preset's monitor and driver in one; a clean run flags nothing
    assert sdc["steps_each"] == 6 and sdc["replay_rounds"] >= 1 and sdc["slowdown_mean"] is not None
    assert sdc["decisions_on_a_clean_run"] == [] and sdc["verdicts_on_a_clean_run"] == []
    assert "SDC, the `default` preset on the device" in proc.stdout
    assert "CPU smoke run" in proc.stdout


def test_gpu_check_refuses_to_run_without_a_device_unless_smoke() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    from benchmarks.gpu_check import main

    assert main(["--out", os.devnull]) == 2
