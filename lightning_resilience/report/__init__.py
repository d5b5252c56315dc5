"""The end-of-run resilience report: one JSON file, one table and a few pictures of what every component did, what
it cost, and why each attempt of the job ended.

Framework-free. The package is split along its seams:

* :mod:`.model`: :class:`ResilienceReport`, its JSON form, reading and writing ``resilience_report.json``;
* :mod:`.assemble`: a report from the components' sections, with the figures the simulator reads;
* :mod:`.failures`, :mod:`.attribution` and :mod:`.stacks`: the culprit and the victims of each attempt's end;
* :mod:`.rundir`: the evidence a run directory holds (ledger, fault notes, stack dumps, launcher records);
* :mod:`.timeline` and :mod:`.timeline_plot`: the goodput timeline of the whole job, and its picture;
* :mod:`.render` and :mod:`.plots`: the tables and the pictures (matplotlib optional).

:func:`write_report` is the one call that does it all for a run directory, in a safe order: the JSON first, then
the pictures, each step failing alone.
"""

from __future__ import annotations

from lightning_resilience.attribution.engine import (
    AttemptEvidence,
    Attribution,
    FailureKind,
    RankExit,
    RankFailure,
    Role,
    attribute,
)
from lightning_resilience.report.assemble import assemble, checkpoint_section
from lightning_resilience.report.model import REPORT_FORMAT, REPORT_NAME, ResilienceReport, load_report, save_json
from lightning_resilience.report.plots import plot
from lightning_resilience.report.render import format_bytes, render_table
from lightning_resilience.report.rundir import explain_run, read_run
from lightning_resilience.report.timeline import Timeline, build_timeline
from lightning_resilience.report.timeline_plot import draw_timeline
from lightning_resilience.report.writer import ReportFiles, explain, write_report

__all__ = [
    "REPORT_FORMAT",
    "REPORT_NAME",
    "AttemptEvidence",
    "Attribution",
    "FailureKind",
    "RankExit",
    "RankFailure",
    "ReportFiles",
    "ResilienceReport",
    "Role",
    "Timeline",
    "assemble",
    "attribute",
    "build_timeline",
    "checkpoint_section",
    "draw_timeline",
    "explain",
    "explain_run",
    "format_bytes",
    "load_report",
    "plot",
    "read_run",
    "render_table",
    "save_json",
    "write_report",
]
