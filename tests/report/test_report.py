"""The end-of-run resilience report: assembly from sections, the simulator's schema, rendering, files, plots."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.manager import CheckpointStats, TierStats
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.tier import Tier
from lightning_resilience.report import (
    REPORT_NAME,
    ResilienceReport,
    assemble,
    checkpoint_section,
    load_report,
    plot,
    render_table,
    save_json,
)
from lightning_resilience.sim.from_run import load_run_costs


def _checkpoint(tmp_path: Path) -> dict[str, Any]:
    tiers: list[Tier] = [MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path / "ckpt", every_n_steps=10, keep=3)]
    stats = CheckpointStats(
        captures=40,
        capture_seconds=0.2,
        capture_seconds_max=0.02,
        state_bytes=3 << 20,
        host_bytes=9 << 20,
        tiers={
            "memory": TierStats(writes=40, bytes=40 * (3 << 20), last_step=40),
            "local": TierStats(writes=4, bytes=4 * (3 << 20), seconds=1.2, last_step=40, failures=1),
        },
        restored_step=20,
        restored_from="local",
        restore_seconds=0.5,
    )
    return checkpoint_section(stats, tiers, restores=1, blocking_timeline=[(s, 0.005) for s in range(1, 41)])


def _ft() -> dict[str, Any]:
    """A ledger of two attempts: a hang detected after 30 s, then an in-job restart 40 s after the last step."""
    attempts = [
        {
            "index": 0, "restart_count": 0, "launcher": "torchrun", "world_size": 2, "started_at": 0.0,
            "first_step_at": 10.0, "start_step": 0, "last_heartbeat_at": 110.0, "last_step": 25, "steps": 25,
            "end_reason": "hang", "faults": [{"kind": "hang", "detection_s": 30.0, "detected_at": 140.0}],
        },
        {
            "index": 1, "restart_count": 1, "launcher": "torchrun", "world_size": 2, "started_at": 120.0,
            "first_step_at": 150.0, "start_step": 20, "last_heartbeat_at": 300.0, "last_step": 60, "steps": 40,
            "end_reason": None, "faults": [],
        },
    ]  # fmt: skip
    ettr = {"ettr": 0.7, "wall_s": 300.0, "productive_s": 210.0, "restarts": 1, "attempts": 2, "causes": ["hang"]}
    return {"attempts": attempts, "ettr": ettr, "timeouts_s": {"step": 30.0}, "exit_code": 0}


def _report(tmp_path: Path) -> ResilienceReport:
    sections = {
        "checkpoint": _checkpoint(tmp_path),
        "fault_tolerance": _ft(),
        "straggler_detection": {"step_time_median_s": [0.1, 0.12, float("nan")], "verdicts": [{"rank": 2}]},
        "sdc_verification": {"detections": {"replay": 1}, "events": [], "steps": 60},
    }
    return assemble(sections, summaries={"checkpoint": "tiered checkpoint: ok"}, step_seconds=0.25, gpus=2,
                    gpus_per_node=2, created=1.0)  # fmt: skip


def test_assemble_derives_the_simulator_figures(tmp_path: Path) -> None:
    report = _report(tmp_path)
    assert report.tiers["memory"] == {
        "every_n_steps": 1, "blocking_seconds": pytest.approx(0.005), "write_seconds": 0.0, "restore_seconds": 0.0,
        "durability": "process", "keep": 2,
    }  # fmt: skip
    # the RAM tier triggers every snapshot; the disk tier copies in the background
    assert report.tiers["local"]["blocking_seconds"] == 0.0
    assert report.tiers["local"]["write_seconds"] == pytest.approx(0.3)
    assert report.tiers["local"]["restore_seconds"] == 0.5
    assert report.tiers["local"]["durability"] == "host"
    assert report.restart_seconds == {"in_job": pytest.approx(40.0)}
    assert report.detection_seconds == {"hang": 30.0}
    assert report.failures == {"count": 1, "wall_seconds": 300.0}


def test_without_a_ram_tier_every_persistent_tier_blocks(tmp_path: Path) -> None:
    tiers = [LocalTier(tmp_path / "a", every_n_steps=5), LocalTier(tmp_path / "b", every_n_steps=20, name="b")]
    stats = CheckpointStats(captures=4, capture_seconds=0.4, tiers={"local": TierStats(), "b": TierStats()})
    section = checkpoint_section(stats, tiers)
    assert [t["blocking_seconds"] for t in section["tiers"].values()] == [pytest.approx(0.1)] * 2


def test_saved_report_loads_in_the_simulator_reader(tmp_path: Path) -> None:
    path = save_json(_report(tmp_path), tmp_path)
    assert path == tmp_path / REPORT_NAME
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # atomic: no temporary left behind
    data = json.loads(path.read_text())
    assert data["sections"]["straggler_detection"]["step_time_median_s"][2] is None  # NaN is not JSON
    costs = load_run_costs(tmp_path)
    assert costs.step_s == 0.25 and costs.gpus == 2 and costs.gpus_per_node == 2
    by_name = {t.name: t for t in costs.tiers}
    assert by_name["local"].every_n_steps == 10 and by_name["local"].keep == 3
    assert by_name["local"].write_s == pytest.approx(0.3) and by_name["local"].durability == "host"
    assert by_name["memory"].durability == "process" and by_name["memory"].blocking_s == pytest.approx(0.005)
    assert costs.restart_s == {"in_job": pytest.approx(40.0)}
    assert costs.detection_s == {"hang": 30.0}
    assert costs.observed_mttf_s == 300.0
    again = load_report(tmp_path)
    assert again.to_json() == data


def test_load_report_rejects_what_is_not_a_report(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no resilience report"):
        load_report(tmp_path)
    (tmp_path / REPORT_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_report(tmp_path)
    (tmp_path / REPORT_NAME).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="unknown report format"):
        load_report(tmp_path)


def _text(report: ResilienceReport) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render_table(report))
    return console.export_text()


def test_render_table_shows_every_section_present(tmp_path: Path) -> None:
    text = _text(_report(tmp_path))
    assert "Checkpoints per tier" in text and "memory" in text and "local" in text
    assert "12.00 MiB" in text  # bytes written by the disk tier
    assert "ETTR" in text and "0.700" in text
    assert "restart (in_job)" in text and "40.00 s" in text
    assert "straggler_detection verdicts" in text and "sdc_verification detections" in text
    bare = _text(assemble({"run": {"status": "finished", "global_step": 3}}))
    assert "Checkpoints per tier" not in bare and "ETTR" not in bare
    assert "finished" in bare


def test_plot_writes_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    files = plot(_report(tmp_path), tmp_path / "plots")
    assert sorted(p.name for p in files) == ["checkpoint_blocking.png", "step_times_per_rank.png"]
    for p in files:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    series = assemble({"straggler": {"step_times_s": [[0.1, 0.2], [0.11, math.nan]]}})
    assert [p.name for p in plot(series, tmp_path / "series")] == ["step_times_per_rank.png"]
    assert plot(assemble({}), tmp_path / "none") == []


def test_plot_is_skipped_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert plot(_report(tmp_path), tmp_path / "plots") == []
    assert not (tmp_path / "plots").exists()
