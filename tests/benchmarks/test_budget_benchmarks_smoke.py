"""Smoke tests of the cost-budget benchmarks: tiny quick runs end with sane JSON and render (no timing assertions:
the figures depend on the shared machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(module: str, tmp_path: Path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / f"{module}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", f"benchmarks.{module}", "--quick", "--preset", "tiny", "--out", str(out),
           "--tmpdir", str(tmp_path), *extra]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.timeout(300)
def test_budget_benchmark_says_what_the_engine_chose_and_what_it_cost(tmp_path: Path) -> None:
    from benchmarks.checkpoint_budget import readme_summary

    r, stdout = _run("checkpoint_budget", tmp_path, "--turn", "12", "--warmup", "12")
    assert set(r["step_time"]) == {"none", "every_step", "budget", "budget_disk"}
    memory = r["cadence"]["budget"]["tiers"]["memory"]
    assert memory["set_by"] == "budget" and memory["reason"] and memory["every_n_steps"] >= 1
    assert set(r["cadence"]["budget_disk"]["tiers"]) == {"memory", "local"}
    assert all(isinstance(v, float) for v in r["engine_cost"].values())
    assert len(r["targets"]) == 4 and "load" in r["machine"]
    assert "tier `memory`: every" in stdout and "checkpoint cost budget" in readme_summary(r)


@pytest.mark.timeout(300)
def test_cadence_ettr_benchmark_simulates_every_point_with_the_measured_costs(tmp_path: Path) -> None:
    from benchmarks.cadence_ettr import BUDGETED, FIXED, readme_summary

    r, stdout = _run("cadence_ettr", tmp_path, "--measure-steps", "24", "--days", "0.5")
    costs = r["costs"]
    assert costs["step_s"] > 0 and costs["write_s"] > 0 and costs["persist_s"] >= costs["snapshot_s"] > 0
    assert [(p["mtbf_h_at_1024"], p["ranks"]) for p in r["points"]] == [(1, 1024), (1, 16384), (8, 1024), (8, 16384)]
    for p in r["points"]:
        assert set(p["variants"]) == {BUDGETED, *FIXED}
        chosen = {c["tier"]: c for c in p["variants"][BUDGETED]["cadences"]}
        assert chosen["disk"]["set_by"] in ("daly", "write", "budget") and chosen["memory"]["set_by"] == "budget"
        assert all(0 <= v["ettr_mean"] <= 1 for v in p["variants"].values())
    assert "the budget chose" in stdout and readme_summary(r).startswith("**checkpoint cadence at scale**")
