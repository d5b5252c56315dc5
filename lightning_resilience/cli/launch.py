"""``lightning-resilience launch [torchrun's flags] [launcher flags] SCRIPT [args]``: torchrun with restarts that come
up, progress-based termination, and a record of every attempt (see docs/launching.md)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from lightning_resilience.cli._common import CliError, non_negative

__all__ = ["launch_main"]

_OURS = ("run_dir", "max_no_progress_restarts", "iteration_file", "term_timeout", "no_standby")
_ENABLE_ENV = "LIGHTNING_RESILIENCE"
DEFAULT_RUNS = "lightning_resilience_runs"
"""Where run directories go when none is named: ``./lightning_resilience_runs/<run id>``."""
_TORCHRUN_DEFAULT_ID = "none"  # torchrun's --rdzv-id when not given


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from err
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """torchrun's own parser (every torchrun flag, same defaults), with the launcher's flags added."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "lightning-resilience launch"
    parser.description = (
        "torchrun, one attempt at a time: restarts decided from how the ranks ended and the committed steps, "
        "each attempt recorded in RUN_DIR/launch/attempts.jsonl. Exit codes: docs/launching.md."
    )
    ours = parser.add_argument_group("lightning-resilience")
    ours.add_argument(
        "--run-dir",
        default=None,
        help="run directory: attempt records go to RUN_DIR/launch, the workers' records are read there (default: "
        f"run_dir= of ${_ENABLE_ENV}, else {DEFAULT_RUNS}/<run id>, said at start)",
    )
    ours.add_argument(
        "--max-no-progress-restarts",
        type=non_negative,
        default=3,
        help="stop with exit 88 (NO_PROGRESS, do not requeue) after this many attempts in a row committed no newer "
        "step (0: never; default 3, as NVRx)",
    )
    ours.add_argument(
        "--iteration-file",
        default=None,
        help="a file holding the newest committed step (NVRx's --ft-checkpoint-iteration-file), for checkpoints this "
        "node cannot list",
    )
    ours.add_argument(
        "--term-timeout",
        type=_positive_float,
        default=25.0,
        help="seconds the workers get to save and end after a SIGTERM before torchrun is stopped (default 25: "
        "under Slurm's and Kubernetes' 30 s grace)",
    )
    ours.add_argument(
        "--no-standby",
        action="store_true",
        help="start every rank cold: no standby workers that import the script's imports ahead of each attempt, no "
        "torchrun agent started ahead (docs/launching.md, warm restarts)",
    )
    return parser


def _run_dir_from_env() -> str | None:
    """``run_dir=...`` of the zero-code enablement variable, e.g. LIGHTNING_RESILIENCE="default run_dir=/shared/r17"."""
    try:
        tokens = shlex.split(os.environ.get(_ENABLE_ENV, ""))
    except ValueError as err:
        raise CliError(f"${_ENABLE_ENV}: {err}") from err
    for token in tokens:
        if token.startswith("run_dir="):
            return token.split("=", 1)[1] or None
    return None


def launch_main(argv: list[str]) -> int:
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    from lightning_resilience.launch.launcher import SCHEDULER_JOB_ENVS, Launcher, LaunchOptions

    args = build_parser().parse_args(argv)
    explicit_id = None if args.rdzv_id in (None, _TORCHRUN_DEFAULT_ID) or args.standalone else str(args.rdzv_id)
    run_dir = args.run_dir or _run_dir_from_env()
    if not run_dir:  # torchrun needs no directory: neither does its replacement
        job = explicit_id or next((os.environ[e] for e in SCHEDULER_JOB_ENVS if os.environ.get(e)), None)
        name = job or time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
        run_dir = os.path.join(DEFAULT_RUNS, name)
        print(
            f"lightning-resilience launch: no --run-dir given: the run directory is {run_dir} (attempt records, the "
            "workers' progress records and fault notes); pass --run-dir DIR to choose one",
            file=sys.stderr,
            flush=True,
        )
    if args.max_restarts < 0:
        raise CliError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    torchrun = {k: v for k, v in vars(args).items() if k not in _OURS}
    try:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        nproc = determine_local_world_size(args.nproc_per_node)
    except ValueError as err:
        raise CliError(str(err)) from err
    options = LaunchOptions(
        run_dir=Path(run_dir),
        max_restarts=args.max_restarts,
        max_no_progress_restarts=args.max_no_progress_restarts,
        iteration_file=Path(args.iteration_file) if args.iteration_file else None,
        term_timeout_s=args.term_timeout,
        nproc_per_node=nproc,
        multi_node=max_nodes > 1,
        run_id=explicit_id,
        standby=not args.no_standby,
    )
    return Launcher(options, torchrun, ["lightning-resilience", "launch", *argv]).run()
