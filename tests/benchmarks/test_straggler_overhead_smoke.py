"""The paired straggler-overhead benchmark: its pairing of neighbouring spans (on made-up periods), and a ``--quick``
run end to end on 2 DDP ranks that writes sane JSON (no timing assertions: the figures depend on the machine)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.straggler_detection import WARM_STEPS
from benchmarks.straggler_overhead import _pairs

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_each_pair_of_neighbouring_spans_gives_the_share_and_drift_cancels() -> None:
    span, steps = 10, 100
    drift = [1.0 + 0.0005 * i for i in range(steps)]  # the machine slows down through the run by 5%
    ratios, on_n, off_n = [], 0, 0
    for start_on in (True, False):  # as the benchmark's fits do, every other one starting off
        on = [((i // span) % 2 == 0) == start_on for i in range(steps)]
        periods = [d * (1.03 if o else 1.0) for d, o in zip(drift, on)]
        ranks = [{"on": on, "periods_s": periods[:-1]}, {"on": on, "periods_s": periods[:-1]}]
        r, on_p, off_p = _pairs(ranks, span)
        assert len(r) == (steps - 1 - WARM_STEPS) // (2 * span)  # whole pairs after the warm-up
        ratios += r
        on_n, off_n = on_n + len(on_p), off_n + len(off_p)
    # one pair is off by the drift over a span (0.5%), the two phases by as much the other way: their mean is exact
    assert all(0.02 < r < 0.04 for r in ratios), ratios
    assert sum(ratios) / len(ratios) == pytest.approx(0.03, abs=5e-4)
    assert on_n == off_n == len(ratios) * span


@pytest.mark.timeout(300)
def test_quick_run_writes_the_paired_share(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.straggler_overhead", "--quick", "--workloads", "device", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "| target |" in proc.stdout
    r = json.loads(out.read_text())
    assert r["quick"] and set(r["workloads"]) == {"device"}
    res = r["workloads"]["device"]
    assert res["pairs"] == 4 and len(res["per_pair"]) == 4  # 2 fits of 60 steps, spans of 10 after the warm-up
    assert math.isfinite(res["share_mean"]) and res["share_interval95"][0] <= res["share_mean"]
    assert res["on"]["n"] == res["off"]["n"] == 40 and res["hooks_s_per_step_on"] > 0
    assert [t["verdict"] in ("PASS", "MISS") for t in r["targets"]] == [True]
