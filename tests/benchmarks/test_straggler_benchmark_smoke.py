"""Smoke test of the straggler benchmark: ``--quick`` with small sizes runs end to end (real 2-rank DDP launches and
the synthetic cross-check) and writes sane JSON.

No timing or quality assertions: the figures depend on the (shared) machine; only structure and consistency.
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

pytestmark = pytest.mark.timeout(300)


def test_straggler_benchmark_quick_run_writes_figures(tmp_path: Path) -> None:
    out = tmp_path / "straggler.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    sizes = ["--onset-min", "24", "--onset-max", "25", "--post-steps", "12", "--ab-steps", "30"]
    sizes += ["--synth-world", "4", "--synth-steps", "140", "--synth-clean-steps", "200"]
    cmd = [sys.executable, "-m", "benchmarks.straggler_detection", "--quick", *sizes, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| target (real ranks) |" in proc.stdout
    result = json.loads(out.read_text())

    for key in ("benchmark", "command", "date", "machine", "config", "real", "synthetic", "targets"):
        assert key in result, key
    assert result["command"].startswith("python -m benchmarks.straggler_detection --quick")
    real = result["real"]["device"]
    assert set(real["groups"]) == {"compute@1.2", "data@1.2", "compute@1.5", "data@1.5"}
    for g in real["groups"].values():
        assert g["trials"] == 1 and g["named"] in (0, 1) and len(g["latency_steps"]) == g["named"]
        assert all(isinstance(x, int) and x >= 1 for x in g["latency_steps"])
    assert real["job"]["trials"] == 1
    assert real["clean"]["steps"] == 30 and real["clean"]["false_verdicts"] >= 0
    over = real["overhead"]
    assert over["step_period_plain"]["mean_s"] > 0 and math.isfinite(over["mean_fraction"])
    assert over["hooks_s_per_step_mean"] > 0
    # the third arm: the step path alone, which the detector's own share is measured against
    assert over["step_period_path"]["mean_s"] > 0 and over["path_driver_s_per_step_mean"] > 0
    assert math.isfinite(over["own_mean_fraction"]) and math.isfinite(over["path_mean_fraction"])
    synth = result["synthetic"]
    assert synth["world"] == 4 and len(synth["groups"]) == 8 and synth["clean"]["steps"] == 200
    assert {t["verdict"] for t in result["targets"]} <= {"PASS", "MISS"} and len(result["targets"]) == 7

    from benchmarks.straggler_detection import TITLE, render_markdown

    text = render_markdown(result)
    assert text.startswith(f"## {TITLE}") and "Synthetic" in text
