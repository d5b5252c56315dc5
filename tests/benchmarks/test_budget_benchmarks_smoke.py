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
    # the whole cost inside the turns needs steps no snapshot touched: none when every step has one
    assert r["within_turns"]["every_step"] is None
    budget = r["within_turns"]["budget"]  # a turn of 12 steps may hold too few untouched ones
    assert budget is None or isinstance(budget["mean"], float)
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


def test_the_whole_cost_inside_a_turn_counts_the_snapshot_steps_and_the_steps_after_them() -> None:
    """Two turns of 10 steps of 100 ms; a snapshot at the 3rd and 8th step blocks 20 ms and drags the next step by
    30 ms: each turn costs 100 ms more than its ten untouched steps would, 10%."""
    from benchmarks._checkpoint.scenarios import within_turns

    steps, took = [], []
    for _ in range(2):
        for i in range(10):
            snap, after = i in (2, 7), i in (3, 8)
            steps.append(0.1 + (0.02 if snap else 0.0) + (0.03 if after else 0.0))
            took.append(1.0 if snap else 0.0)
    rec = {"budget": {"step_s": steps, "snapshot": took, "turn_s": [sum(steps[:10])] * 2, "tail_steps": [0, 0]}}
    got = within_turns(rec, "budget")
    assert got is not None and got["per_turn"] == pytest.approx([0.1, 0.1]) and got["mean"] == pytest.approx(0.1)
    rec["budget"]["snapshot"] = [1.0] * 20  # a snapshot every step: nothing untouched to measure against
    assert within_turns(rec, "budget") is None
    rec["budget"]["snapshot"] = [0.0] * 20  # a contender that never says where its snapshots are: no figure
    assert within_turns(rec, "budget") is None
