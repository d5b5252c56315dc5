"""`lightning-resilience` command line: run a recipe, list, verify, inspect and export checkpoints, show a run's
resilience report, launch a script under torchrun with restarts that come up, simulate at scale.

One module per command group (``run``, ``launch``, ``ckpt``, ``report``, ``verdict``; ``simulate`` lives in
:mod:`lightning_resilience.sim.cli`), each adding its sub-commands to the parser with ``add_parsers``; ``launch`` and
``simulate`` parse their own arguments (every flag after the word belongs to them).
"""

from __future__ import annotations

import argparse
import sys

from lightning_resilience.cli import ckpt, report, run, verdict
from lightning_resilience.cli._common import CliError

__all__ = ["CliError", "build_parser", "main"]

_DESCRIPTION = __doc__.split("\n\n")[0] if __doc__ else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-resilience", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("simulate", help="predict ETTR and the best checkpoint interval at scale (see simulate --help)")
    sub.add_parser("launch", help="torchrun with restarts that come up and a record of each attempt (launch --help)")
    run.add_parsers(sub)
    ckpt.add_parsers(sub)
    report.add_parsers(sub)
    verdict.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["simulate"]:  # its own parser: every flag after the word belongs to the simulator
        from lightning_resilience.sim.cli import simulate_main

        return int(simulate_main(argv[1:]))
    try:
        if argv[:1] == ["launch"]:  # torchrun's flags, then the script's own: parsed by torchrun's parser
            from lightning_resilience.cli.launch import launch_main

            return launch_main(argv[1:])
        args = build_parser().parse_args(argv)
        return int(args.fn(args))
    except CliError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
