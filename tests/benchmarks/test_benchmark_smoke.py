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
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.checkpoint_blocking",
            "--quick",
            "--preset",
            "tiny",
            "--out",
            str(out),
            "--tmpdir",
            str(tmp),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "| target |" in proc.stdout  # the summary table was printed
    return json.loads(out.read_text())


def test_top_level_keys(quick_result: dict) -> None:
    for key in (
        "benchmark",
        "command",
        "date",
        "machine",
        "config",
        "step_time",
        "blocking",
        "persist",
        "restore",
        "lightning",
        "ratios",
        "targets",
    ):
        assert key in quick_result, key
    assert quick_result["benchmark"] == "checkpoint_blocking"
    assert quick_result["command"].startswith("python -m benchmarks.checkpoint_blocking")
    assert quick_result["config"]["quick"] is True
    machine = quick_result["machine"]
    assert machine["torch"] and _positive(machine["cpu_count"])


def test_blocking_figures_positive(quick_result: dict) -> None:
    blocking = quick_result["blocking"]
    for key in (
        "ours",
        "ours_on_step",
        "ours_persist_steps",
        "ours_no_overlap",
        "ours_ram_only",
        "ours_every_step",
        "floor_copy",
        "torch_save",
        "dcp_save",
        "dcp_async_save",
    ):
        stats = blocking[key]
        assert stats["n"] >= 1, key
        assert _positive(stats["median_s"]), key
        assert len(stats["samples_s"]) == stats["n"]
    # the wait in the optimizer pre-hook may be ~0 but is measured for every overlapped snapshot
    hook = blocking["ours_hook_wait"]
    assert hook["n"] == blocking["ours"]["n"] and hook["min_s"] >= 0
    assert blocking["ours_no_overlap_hook_wait"]["max_s"] == 0
    assert _positive(quick_result["step_time"]["baseline_median_s"])
    assert _positive(quick_result["config"]["state_bytes"])


def test_persist_restore_and_lightning_figures(quick_result: dict) -> None:
    persist = quick_result["persist"]
    assert _positive(persist["baseline_iteration"]["mean_s"])
    assert _positive(persist["persist_iteration"]["mean_s"])
    assert persist["local_writes"] >= 1
    cadence = persist["cadence"]
    assert _positive(cadence["baseline_iteration"]["mean_s"])
    assert cadence["iteration"]["n"] == cadence["window_steps"] * cadence["rounds"]
    assert cadence["local_writes"] == cadence["persists_per_window"] * cadence["rounds"]
    assert cadence["steps_in_flight"] + cadence["iteration_no_persist_in_flight"]["n"] == cadence["iteration"]["n"]
    assert isinstance(cadence["slowdown_mean"], float)
    restore = quick_result["restore"]
    for key in ("ram", "disk_warm", "disk_cold"):
        assert _positive(restore[key]["median_s"]), key
        assert _positive(restore[f"{key}_apply"]["median_s"]), key
        assert restore[f"{key}_total"]["median_s"] >= restore[key]["median_s"], key
    runs = quick_result["lightning"]["runs"]
    for kind in ("none", "tiered", "modelcheckpoint", "modelcheckpoint_async"):
        assert _positive(runs[kind]["step_interval"]["median_s"]), kind
    assert _positive(runs["tiered"]["tiered_capture"]["median_s"])


def test_ratios_and_targets(quick_result: dict) -> None:
    ratios = quick_result["ratios"]
    for key in (
        "torch_save_over_ours",
        "dcp_async_save_over_ours",
        "ours_blocking_fraction_of_step",
        "restore_disk_warm_over_ram",
        "restore_applied_disk_warm_over_ram",
        "ours_no_overlap_over_ours",
    ):
        assert _positive(ratios[key]), key
    assert isinstance(ratios["persist_slowdown_mean"], float)
    assert isinstance(ratios["persist_slowdown_cadence_mean"], float)
    targets = quick_result["targets"]
    assert len(targets) == 6
    assert {t["verdict"] for t in targets} <= {"PASS", "MISS"}


def test_docs_render_from_result(quick_result: dict) -> None:
    from benchmarks.checkpoint_blocking import render_markdown

    text = render_markdown(quick_result)
    assert quick_result["command"] in text
    assert "| target |" in text
