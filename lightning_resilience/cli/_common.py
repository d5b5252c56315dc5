"""Shared pieces of the command line: the user-error type, console output, argument types."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["CliError", "console", "non_negative", "progress"]


class CliError(Exception):
    """A problem with what the user asked for; printed as ``error: ...`` with exit status 2."""


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    # not a terminal (a pipe, a log, a test): wide enough that paths are not wrapped
    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=None if stream.isatty() else 200)


def progress(*, nbytes: bool) -> Any:
    """A progress bar on stderr (nothing when stderr is not a terminal); ``nbytes``: the total counts bytes."""
    from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    err_console = console(stderr=True)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn() if nbytes else MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,  # a bar in a log file is noise
    )


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from err
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value
