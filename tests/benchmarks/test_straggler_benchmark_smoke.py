"""Smoke test of the straggler benchmark: ``--quick`` with small sizes runs end to end and writes sane JSON.

No timing assertions: the figures depend on the (shared) machine. Detection figures come from simulated trials and
are checked for structure and internal consistency only.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_straggler_benchmark_quick_run_writes_figures(tmp_path: Path) -> None:
    out = tmp_path / "straggler.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    sizes = [
        "--world",
        "4",
        "--trials",
        "3",
        "--trial-steps",
        "120",
        "--clean-steps",
        "300",
        "--width",
        "64",
        "--batch",
        "16",
    ]
    cmd = [sys.executable, "-m", "benchmarks.straggler_detection", "--quick", *sizes, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| target |" in proc.stdout
    result = json.loads(out.read_text())

    for key in ("benchmark", "command", "date", "machine", "config", "detection", "overhead", "targets"):
        assert key in result, key
    assert result["benchmark"] == "straggler_detection"
    assert result["command"].startswith("python -m benchmarks.straggler_detection --quick")
    assert result["config"]["quick"] is True and result["config"]["world"] == 4

    factors = result["detection"]["factors"]
    assert set(factors) == {"1.1", "1.2", "1.5", "2.0"}
    for d in factors.values():
        assert d["trials"] == 3 and d["detected"] + d["missed"] == 3
        assert 0.0 <= d["recall"] <= 1.0
        assert len(d["latency_steps"]) == d["detected"]
        assert all(isinstance(x, int) and x >= 1 for x in d["latency_steps"])
    clean = result["detection"]["clean"]
    assert clean["steps"] == 300 and clean["false_alarms"] >= 0

    over = result["overhead"]
    assert over["step_plain"]["median_s"] > 0 and over["detector_median_s"] > 0
    assert math.isfinite(over["overhead_fraction"]) and over["overhead_fraction"] > 0
    assert {t["verdict"] for t in result["targets"]} <= {"PASS", "MISS"} and len(result["targets"]) == 5

    from benchmarks.straggler_detection import TITLE, render_markdown

    text = render_markdown(result)
    assert text.startswith(f"## {TITLE}")
    assert "false alarm" in text
