"""``lightning-resilience report``: a run's resilience report as tables."""

from __future__ import annotations

import argparse
from typing import Any

from lightning_resilience.cli._common import CliError, console

__all__ = ["add_parsers", "cmd_report"]


def cmd_report(args: argparse.Namespace) -> int:
    from lightning_resilience.report import load_report, render_table

    try:
        report = load_report(args.run_dir)
    except (FileNotFoundError, ValueError) as err:
        raise CliError(str(err)) from err
    out = console()
    out.print(render_table(report))
    if args.summaries:
        for name, text in report.summaries.items():
            out.print(f"[bold]{name}[/bold]")
            out.print(text, highlight=False, markup=False)
    return 0


def add_parsers(sub: Any) -> None:
    report = sub.add_parser("report", help="show the resilience report of a run directory")
    report.add_argument("run_dir", help="run directory (or its resilience_report.json)")
    report.add_argument("--summaries", action="store_true", help="also print each component's summary text")
    report.set_defaults(fn=cmd_report)
