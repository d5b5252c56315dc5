"""The goodput timeline of a whole job: bands of wall-clock time that add up, recomputed steps, restores,
persists; the picture drawn from it, and nothing drawn (nothing failing) without matplotlib."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

from lightning_resilience.ft.ettr import EttrLedger
from lightning_resilience.report.rundir import explain_run
from lightning_resilience.report.timeline import BAND_KINDS, Timeline, build_timeline
from lightning_resilience.report.timeline_plot import draw_timeline
from tests.report._rundir import Clock, write_job


def test_the_bands_cover_the_wall_clock_once_and_agree_with_the_ledger(tmp_path: Path) -> None:
    _, _, timeline = explain_run(write_job(tmp_path))
    assert timeline is not None
    bands = sorted(timeline.bands, key=lambda b: b.start)
    assert bands[0].start == pytest.approx(0.0)
    for a, b in itertools.pairwise(bands):
        assert b.start == pytest.approx(a.end), (a, b)  # no gap, no overlap
    assert bands[-1].end == pytest.approx(timeline.wall_s)
    seconds = timeline.seconds_by_kind()
    assert set(seconds) == set(BAND_KINDS)
    assert sum(seconds.values()) == pytest.approx(timeline.wall_s)
    # the writer's clock: hang detected 12 s after the last step; the preempted attempt requeued 30 s later
    assert seconds["detection"] >= 12.0
    assert timeline.ettr["restarts"] == 3 and 0.0 < timeline.ettr["ettr"] < 1.0


def test_recomputed_steps_restores_and_persists_are_on_the_attempts(tmp_path: Path) -> None:
    _, _, timeline = explain_run(write_job(tmp_path))
    assert timeline is not None
    hang, preempted, killed, last = timeline.attempts
    assert (preempted.restored_step, preempted.restored_from, preempted.restore_s) == (20, "local", 0.25)
    assert preempted.recompute_until == 25  # steps 20..25 redo what the hung attempt had done
    assert killed.recompute_until is None  # the preemption saved its last step: nothing lost
    assert last.recompute_until == 57 and last.restored_step == 50
    assert hang.persists and all(step > 0 and tier == "local" for _, step, tier in hang.persists)
    # a persist is only recorded for steps past the one the attempt resumed from
    assert all(step > 20 for _, step, _ in preempted.persists)
    recompute = sum(b.seconds for b in timeline.bands if b.kind == "recompute")
    assert recompute == pytest.approx((25 - 20 + 57 - 50) * 0.5)
    assert [a.end["outcome"] if a.end else None for a in timeline.attempts] == [
        "fault",
        "preempted",
        "fault",
        "finished",
    ]


def test_the_timeline_survives_its_json(tmp_path: Path) -> None:
    _, _, timeline = explain_run(write_job(tmp_path))
    assert timeline is not None
    again = Timeline.from_json(timeline.to_json())
    assert again.to_json() == timeline.to_json()


def test_a_single_attempt_still_running(tmp_path: Path) -> None:
    clock = Clock()
    ledger = EttrLedger(tmp_path, wall_clock=clock, interval_s=0.0)
    ledger.begin_attempt(restart_count=0, launcher="none", world_size=1, job_id=None)
    clock.t += 2.0
    ledger.first_step(0)
    for step in range(1, 11):
        clock.t += 1.0
        ledger.heartbeat(step)
    timeline = build_timeline(ledger.attempts)
    assert [b.kind for b in timeline.bands] == ["startup", "productive"]
    assert timeline.attempts[0].time_at_step(5) == pytest.approx(7.0)
    assert build_timeline([]).attempts == []


def test_the_picture_is_drawn_as_png_and_svg(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _, _, timeline = explain_run(write_job(tmp_path / "run"))
    assert timeline is not None
    files = draw_timeline(timeline, tmp_path / "out")
    assert [p.name for p in files] == ["timeline.png", "timeline.svg"]
    assert files[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and files[0].stat().st_size > 20_000
    svg = files[1].read_text()
    assert "why each attempt ended" in svg and "culprit rank 1" in svg


def test_without_matplotlib_nothing_is_drawn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, timeline = explain_run(write_job(tmp_path / "run"))
    assert timeline is not None
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert draw_timeline(timeline, tmp_path / "out") == []
    assert not (tmp_path / "out").exists()


def test_a_restart_gap_is_split_into_relaunch_imports_rendezvous_setup_and_restore(tmp_path: Path) -> None:
    """With the moments a ledger records (process start, script ready, restore end), each second of the gap is in
    its band, and the bands still tile the wall clock."""
    clock = Clock()
    ledger = EttrLedger(tmp_path, wall_clock=clock, interval_s=0.0)
    ledger.begin_attempt(restart_count=0, launcher="torchrun", world_size=2, job_id="j")
    clock.t += 1.0
    ledger.first_step(0)
    for step in range(1, 11):
        clock.t += 0.5
        ledger.heartbeat(step)
    clock.t += 2.0
    ledger.end_attempt("exception")  # detected 2 s after the last step
    clock.t += 1.0
    process = clock.t  # relaunch: 1 s
    clock.t += 4.0
    ready = clock.t  # imports: 4 s
    clock.t += 1.5
    ledger = EttrLedger(tmp_path, wall_clock=clock, interval_s=0.0)  # rendezvous: 1.5 s
    ledger.begin_attempt(restart_count=1, launcher="torchrun", world_size=2, job_id="j",
                         process_started_at=process, script_ready_at=ready)  # fmt: skip
    clock.t += 0.4
    ledger.first_step(10, restored_step=10, restored_from="memory", restore_s=0.1, restored_at=clock.t - 0.2)
    clock.t += 0.5
    ledger.first_step_done()
    ledger.heartbeat(11)
    ledger.end_attempt("finished")
    timeline = build_timeline(ledger.attempts)
    seconds = timeline.seconds_by_kind()
    assert seconds["detection"] == pytest.approx(2.0) and seconds["relaunch"] == pytest.approx(1.0)
    assert seconds["imports"] == pytest.approx(4.0) and seconds["rendezvous"] == pytest.approx(1.5)
    assert seconds["restore"] == pytest.approx(0.1) and seconds["startup"] == pytest.approx(1.0 + 0.3)
    bands = sorted(timeline.bands, key=lambda b: b.start)
    for a, b in itertools.pairwise(bands):
        assert b.start == pytest.approx(a.end), (a, b)
    assert sum(seconds.values()) == pytest.approx(timeline.wall_s)
    (cost,) = timeline.ettr["restart_costs"]
    assert cost["steps_lost"] == 0 and cost["fault_to_first_good_step_s"] == pytest.approx(2 + 1 + 4 + 1.5 + 0.4 + 0.5)
