"""The report never fails on any text: markup characters in every field render as written; the JSON is written
before anything is drawn or printed and survives their failure; noise-level straggler notes are not findings;
``lightning-resilience report <run dir>`` explains a job from its directory alone."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from lightning_resilience.cli import main
from lightning_resilience.ft.restart import FaultNote, write_fault_note
from lightning_resilience.report import REPORT_NAME, ResilienceReport, assemble, load_report, render_table, write_report
from tests.report._rundir import Clock, write_job

# what broke the table once, and what else rich would read as markup or emoji
MARKUP = "closing tag '[/__w/pytorch/pytorch/third_party/gloo]' [bold]b[/bold] [link=x]l[/link] [red] :smile: \\[x]"


def _render(report: ResilienceReport, width: int = 400) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(render_table(report))
    return console.export_text()


def _marked_report(tmp_path: Path) -> ResilienceReport:
    """A report whose every text comes from the run and holds markup: section and key names, status, summaries,
    tier names, corrupt-shard messages, a victim's and a culprit's messages, stack paths."""

    def kill(run_dir: Path, clock: Clock) -> None:
        write_fault_note(
            run_dir,
            FaultNote(kind="exception", rank=1, attempt=0, step=57, detected_at=clock.t - 0.1, message=MARKUP),
        )

    run_dir = write_job(tmp_path / "run", kill_notes=kill)
    tier = {"every_n_steps": 1, "durability": "[b]host", "writes": 1, "bytes": 10, "write_seconds": 0.1}
    sections: dict[str, Any] = {
        "run": {"status": f"exception: RuntimeError: {MARKUP}", f"key {MARKUP}": MARKUP},
        "checkpoint": {
            "tiers": {f"tier {MARKUP}": tier},
            "skipped_corrupt": [MARKUP],
            "restored_step": 3,
            "restored_from": MARKUP,
        },
        f"section {MARKUP}": {"value": MARKUP, "verdicts": [MARKUP]},
        "fault_tolerance": {"ettr": {"ettr": 0.5, "wall_s": 2.0}, "attempts": [], "exception": MARKUP},
    }
    report = assemble(sections, summaries={"x": MARKUP})
    files = write_report(report, run_dir, plots=False)
    assert files.errors == []
    return report


def test_markup_in_every_text_field_renders_as_written(tmp_path: Path) -> None:
    report = _marked_report(tmp_path)
    text = _render(report)
    assert text.count(MARKUP) >= 8, text  # status, key, value, tier, skipped, restored from, section, exception
    assert "[/__w/pytorch/pytorch/third_party/gloo]" in text
    culprit = report.attempts[2]["cause"]
    assert culprit["rank"] == 1 and MARKUP in culprit["detail"]  # its own exception, not the peer's reset
    assert f"rank 1: {MARKUP}" in text
    # narrow terminals wrap, they do not fail
    assert "Attempts" in _render(report, width=60)


def test_the_cli_prints_summaries_with_markup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = _marked_report(tmp_path)
    assert main(["report", str(tmp_path / "run"), "--summaries", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert MARKUP in out and report.summaries["x"] == MARKUP


class _BrokenConsole:
    def __init__(self) -> None:
        self.printed: list[str] = []

    def print(self, obj: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(obj, str):
            raise RuntimeError("the terminal went away")
        self.printed.append(obj)


def test_the_json_is_written_first_and_survives_a_failing_table(tmp_path: Path) -> None:
    console = _BrokenConsole()
    report = assemble({"run": {"status": "finished"}})
    files = write_report(report, tmp_path / "out", console=console)
    assert files.json == tmp_path / "out" / REPORT_NAME and load_report(files.json).sections["run"]
    assert any("printing the table: RuntimeError: the terminal went away" in e for e in files.errors)
    # and it says where it wrote, even then
    assert console.printed and str(files.json) in console.printed[-1]


def test_a_failing_step_before_the_json_does_not_lose_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_resilience.report.writer as writer

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("ledger on a dead mount")

    monkeypatch.setattr(writer, "explain_run", broken)
    files = write_report(assemble({"run": {"status": "finished"}}), tmp_path, plots=False)
    assert files.json is not None and files.json.is_file()
    assert files.errors == ["explaining the attempts: OSError: ledger on a dead mount"]


def test_noise_level_straggler_notes_are_not_findings() -> None:
    def decision(action: str, rank: int, slowdown: float) -> dict[str, Any]:
        verdict = {"rank": rank, "slowdown": slowdown, "section": "step", "onset_step": 10, "step": 20}
        return {"action": action, "step": 20, "threshold": 1.2, "verdict": verdict}

    jitter = {"rank": 0, "slowdown": 1.16, "section": "compute", "onset_step": 5, "step": 9, "noise": 0.08}
    section = {"decisions": [decision("log", 1, 1.21)], "verdicts": [{}], "noise_level": [jitter]}
    noise = _render(assemble({"straggler_detection": section}))
    assert "none (no slowdown reached the alert level)" in noise
    assert "noted (log only) │ 1 slowdown(s) up to 1.21x on rank 1: below the alert level, not a finding" in noise
    assert "within noise     │ 1 slowdown(s) up to 1.16x on rank 0: within the run-to-run jitter" in noise
    real = _render(assemble({"straggler_detection": {"decisions": [decision("alert", 3, 1.8)], "noise_level": []}}))
    assert "finding" in real and "rank 3 1.80x slower" in real and "none (no slowdown" not in real


def test_the_cli_explains_a_job_from_its_run_directory_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    run_dir = write_job(tmp_path / "run")  # the job never wrote a resilience_report.json
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "Attempts: why each ended" in out
    assert "rank 1: hung in section 'step'" in out and "SIGTERM on this rank" in out
    assert "died without a trace" in out and "victim rank 0: RuntimeError: Connection closed by peer" in out
    assert f"wrote {run_dir / 'timeline.png'}" in out and (run_dir / "timeline.png").is_file()
    assert not (run_dir / REPORT_NAME).exists()  # showing a report never rewrites the run's record


def test_a_saved_report_is_explained_again_from_the_newest_records(tmp_path: Path) -> None:
    run_dir = write_job(tmp_path / "run")
    (run_dir / REPORT_NAME).write_text(json.dumps(ResilienceReport(created=1.0).to_json()))
    assert main(["report", str(run_dir / REPORT_NAME), "--no-plots", "--out", str(tmp_path / "pics")]) == 0
    assert not (tmp_path / "pics").exists()
