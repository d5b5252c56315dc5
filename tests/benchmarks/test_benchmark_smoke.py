"""Smoke test of the checkpoint benchmark: ``--quick`` on the tiny preset runs end to end and writes sane JSON.

No timing assertions: the figures depend on the (shared) machine. Only structure and positivity are checked.
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


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "checkpoint.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "benchmarks.checkpoint", "--quick", "--preset", "tiny", "--out", str(out),
           "--tmpdir", str(tmp)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "| target |" in proc.stdout  # the summary table was printed
    return json.loads(out.read_text())


@pytest.mark.timeout(480)
def test_structure_and_figures(quick_result: dict) -> None:
    r = quick_result
    assert r["benchmark"] == "checkpoint" and r["command"].startswith("python -m benchmarks.checkpoint")
    assert r["config"]["quick"] is True and _positive(r["config"]["state_bytes"])
    names = {"none", "floor", "ours_ram", "ours", "dcp_best_thread", "dcp_best_process", "dcp_own_thread",
             "dcp_own_process"}  # fmt: skip
    assert set(r["step_time"]) == names
    turn = r["config"]["turn"] * r["config"]["rounds"]
    for name in names:
        stats = r["step_time"][name]
        tail = sum(r["drain"][name]["tail_steps"])  # steps trained on while a write finished
        assert stats["n"] == turn + tail and _positive(stats["mean_s"]) and _positive(stats["max_s"]), name
        assert tail <= r["config"]["turn"] * r["config"]["rounds"], name
    for name in names - {"none"}:
        assert _positive(r["blocking"][name]["mean_s"]), name
        assert isinstance(r["slowdown"][name]["mean"], float), name
        assert r["slowdown"][name]["tail"] == "max"  # fewer than 100 samples: the tail is the maximum, so named
    assert r["ratios"]["best_dcp"].startswith("dcp_best") and r["ratios"]["best_dcp_own_cadence"].startswith("dcp_own")
    assert "ours_ram_over_floor_mean" in r["ratios"]
    assert r["details"]["ours"]["local_writes"] >= 1 and r["details"]["floor"]["host_bytes"] > 0
    assert r["details"]["dcp_best_thread"]["staging_options"]["use_async_staging"] is True
    for source in ("ours_ram", "ours_disk_warm", "ours_disk_cold", "dcp_ram", "dcp_disk_warm"):
        total = r["restore"][source]["total"]["median_s"]
        assert _positive(total) and total >= r["restore"][source]["restore"]["median_s"], source
    pl = r["lightning"]
    assert set(pl["slowdown"]) == {"tiered", "tiered_budget", "modelcheckpoint_same", "modelcheckpoint_best"}
    assert all(_positive(v) for v in pl["mean_step_with_drain_s"].values())
    assert {t["verdict"] for t in r["targets"]} <= {"PASS", "MISS"} and len(r["targets"]) == 4
    load = r["machine"]["load"]
    assert load["cores"] >= 1 and isinstance(load["fit_to_publish"], bool) and r["machine"]["loadavg_at_end"]


def test_renders_section_and_readme_line(quick_result: dict) -> None:
    from benchmarks.checkpoint import readme_summary, render_markdown

    text = render_markdown(quick_result)
    assert quick_result["command"] in text and "| target |" in text and "CPU only" in text
    assert "(max)" in text and "p99_s" not in text
    line = readme_summary(quick_result)
    assert line.startswith("**checkpoint every step**") and "the bare copy of the state (the floor)" in line
