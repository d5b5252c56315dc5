"""Write a report for a run directory in a safe order: explain the attempts, write the JSON, draw, print.

A report is most needed right after a fault, when the text it shows is least predictable; so each step fails
alone (a broken picture or table never loses the JSON), the JSON is written before anything is drawn or printed,
and the caller is told where every file went.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_resilience.report.model import REPORT_NAME, ResilienceReport, save_json
from lightning_resilience.report.plots import plot
from lightning_resilience.report.render import render_table
from lightning_resilience.report.rundir import explain_run
from lightning_resilience.rollback.config import RollbackConfig
from lightning_resilience.rollback.quarantine import read_quarantine
from lightning_resilience.rundir import RunDir

__all__ = ["ReportFiles", "explain", "write_report"]

log = logging.getLogger(__name__)


@dataclass
class ReportFiles:
    """What :func:`write_report` wrote, and what failed."""

    json: Path | None = None
    pictures: list[Path] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def timeline(self) -> Path | None:
        return next((p for p in self.pictures if p.name == "timeline.png"), None)

    def describe(self) -> str:
        where = "resilience report NOT written" if self.json is None else f"resilience report: {self.json}"
        if self.timeline is not None:
            where += f"; goodput timeline: {self.timeline}"
        others = [p for p in self.pictures if p != self.timeline]
        if others:
            where += f"; plots: {', '.join(str(p) for p in others)}"
        if self.errors:
            where += f"; {len(self.errors)} step(s) failed: {'; '.join(self.errors)}"
        return where


def explain(report: ResilienceReport, run_dir: str | Path, *, current_attempt: str | None = None) -> ResilienceReport:
    """Fill ``report.attempts`` (why each attempt ended) and ``report.timeline`` from the run directory's records;
    a run without a ledger of attempts keeps what it has.

    ``current_attempt``: how the newest attempt ended when its ledger entry does not say yet (the report is written
    at the end of ``fit``, before the ledger closes the attempt): 'finished'.
    """
    records, attributions, timeline = explain_run(run_dir, current_attempt=current_attempt)
    if records.attempts:
        report.attempts = [a.to_json() for a in attributions]
        report.timeline = timeline.to_json() if timeline is not None else None
    rollbacks = _quarantine(Path(run_dir))
    if rollbacks:  # every attempt's in-process rollbacks, also when the attempt that made them wrote no report
        report.sections["rollback"] = {
            "rollbacks": [r for r in rollbacks if not r.get("escalated")],
            "escalated": next((r for r in rollbacks if r.get("escalated")), None),
        }
    return report


def _quarantine(run_dir: Path) -> list[dict[str, Any]]:
    """The records of the run directory's quarantine file (in it or in its ``resilience/`` folder)."""
    path = RunDir.locate(run_dir).quarantine(RollbackConfig().quarantine_file)
    return read_quarantine(path) if path.is_file() else []


def write_report(
    report: ResilienceReport,
    run_dir: str | Path,
    *,
    plots: bool = True,
    console: Any = None,
    current_attempt: str | None = None,
) -> ReportFiles:
    """Explain, then write ``<run_dir>/resilience_report.json``, then the pictures, then print the table on
    ``console`` (a ``rich`` Console; None prints nothing); ``current_attempt`` as for :func:`explain`. Never
    raises for a failed step: it is logged and listed in :attr:`ReportFiles.errors`."""
    out = Path(run_dir)
    files = ReportFiles()
    try:
        explain(report, out, current_attempt=current_attempt)
    except Exception as err:  # the figures the components gave are still worth writing
        files.errors.append(f"explaining the attempts: {type(err).__name__}: {err}")
        log.exception("could not read the attempts of %s", out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        files.json = save_json(report, out / REPORT_NAME)
    except Exception as err:
        files.errors.append(f"writing the JSON: {type(err).__name__}: {err}")
        log.exception("could not write the resilience report to %s", out)
    if plots:
        try:
            files.pictures = plot(report, out)
        except Exception as err:
            files.errors.append(f"drawing: {type(err).__name__}: {err}")
            log.exception("could not draw the report's pictures in %s", out)
    if console is not None:
        try:
            console.print(render_table(report))
        except Exception as err:
            files.errors.append(f"printing the table: {type(err).__name__}: {err}")
            log.exception("could not print the resilience report")
        console.print(files.describe(), markup=False, highlight=False)
    return files
