"""Smoke test of the agreement-transport benchmark: ``--quick`` runs end to end on 2 ranks and writes sane JSON (no
timing assertions: the figures depend on the machine)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_three_arms_and_the_rounds_alone_are_measured(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "benchmarks.agreement_transport", "--quick", "--out", str(out), "--width", "64"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "| target |" in proc.stdout
    r = json.loads(out.read_text())
    assert r["quick"] and set(r["arms"]) == {"gloo", "tcp"}
    for arm in r["arms"].values():
        assert len(arm["per_block_slowdown"]) == 3 and math.isfinite(arm["slowdown_mean"])
        assert arm["mean_s"] > 0 and arm["p99_s"] >= arm["median_s"] > 0
    for per_rank in r["round_alone"].values():
        assert len(per_rank) == 2 and all(x["cpu_us"] > 0 and x["latency_us"] > 0 for x in per_rank)
    assert [t["verdict"] in ("PASS", "MISS") for t in r["targets"]] == [True] * 3
