"""``lightning-resilience report``: a run's resilience report as tables, the cause of every attempt's end, and the
job's goodput timeline, from the run directory alone."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lightning_resilience.cli._common import CliError, console

__all__ = ["add_parsers", "cmd_report"]


def cmd_report(args: argparse.Namespace) -> int:
    from lightning_resilience.report import ResilienceReport, explain, load_report, plot, render_table
    from lightning_resilience.report.rundir import find_ledger

    source = Path(args.run_dir)
    run_dir = source.parent if source.is_file() else source
    try:
        report = load_report(source)
    except FileNotFoundError as err:
        if find_ledger(run_dir) is None:
            raise CliError(f"{err} and no ledger of attempts (ft_ledger.json) there either") from err
        report = ResilienceReport()  # the job never got to write its report: explain its attempts anyway
    except ValueError as err:
        raise CliError(str(err)) from err
    explain(report, run_dir)
    out = console()
    out.print(render_table(report))
    if args.summaries:
        for name, text in report.summaries.items():
            out.print(name, style="bold", markup=False, highlight=False)
            out.print(text, highlight=False, markup=False)
    if not args.no_plots:
        pictures = plot(report, Path(args.out) if args.out else run_dir)
        for path in pictures:
            out.print(f"wrote {path}", markup=False, highlight=False)
        if not pictures:
            out.print("no pictures: matplotlib is not installed (pip install lightning-resilience[plots])")
    return 0


def add_parsers(sub: Any) -> None:
    report = sub.add_parser(
        "report", help="show the resilience report of a run directory: causes of restarts, goodput timeline"
    )
    report.add_argument("run_dir", help="run directory (or its resilience_report.json)")
    report.add_argument("--summaries", action="store_true", help="also print each component's summary text")
    report.add_argument("--out", help="where to draw the pictures (default: the run directory)")
    report.add_argument("--no-plots", action="store_true", help="print the tables only")
    report.set_defaults(fn=cmd_report)
