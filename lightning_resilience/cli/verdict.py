"""``lightning-resilience verdict RUN_DIR``: the launcher's last decision, for a batch script.

``srun`` rewrites a job step's exit status when it tears the step down (143 for the tasks it SIGTERMs, NVRx #397),
so a Slurm script cannot tell "do not requeue" (88) from a crash by ``$?``. The launcher writes its decision to
``<run_dir>/launch[/<host>]/verdict.json`` (:class:`~lightning_resilience.rundir.LaunchDir`); this command reads
every node's and answers:

* ``verdict RUN_DIR``: prints the decision and exits with the launcher's exit code;
* ``verdict --requeue RUN_DIR``: exits 0 when the job should be requeued, 1 when not (a node that found no
  progress, a finished job, a stop by hand). No verdict written since ``--since`` (the launcher was killed before
  it could write one: a node failure, ``scancel``) counts as a requeue.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_resilience.cli._common import CliError
from lightning_resilience.launch.policy import requeue_wanted
from lightning_resilience.rundir import RunDir

__all__ = ["add_parsers", "read_verdicts"]


def read_verdicts(run_dir: RunDir, since: float | None = None) -> list[dict[str, Any]]:
    """Every node's verdict written at or after ``since`` (wall clock)."""
    out = []
    for launch in run_dir.launch_dirs():
        try:
            data = json.loads(launch.verdict.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and (since is None or float(data.get("written_at", 0)) >= since):
            out.append({**data, "node": launch.root.name})
    return out


def cmd_verdict(args: Any) -> int:
    verdicts = read_verdicts(RunDir(Path(args.run_dir)), args.since)
    if not verdicts:
        print(f"lightning-resilience verdict: no verdict in {args.run_dir}: the launcher did not finish; requeue")
        if args.requeue:
            return 0
        raise CliError(f"no launcher verdict in {args.run_dir}" + (f" since {args.since}" if args.since else ""))
    # the node that must not be requeued decides for the job; else the first failure's code
    stop = [v for v in verdicts if not requeue_wanted(int(v["exit_code"]))]
    chosen = stop[0] if stop else max(verdicts, key=lambda v: int(v["exit_code"]))
    code = int(chosen["exit_code"])
    wanted = not stop
    print(
        f"lightning-resilience verdict: exit {code} ({chosen.get('reason', '')}); "
        + ("requeue" if wanted else "do not requeue")
    )
    if args.requeue:
        return 0 if wanted else 1
    return code


def add_parsers(sub: Any) -> None:
    verdict = sub.add_parser(
        "verdict", help="the launcher's last decision (exit code, requeue or not) for a batch script"
    )
    verdict.add_argument("run_dir", help="the run directory given to `lightning-resilience launch`")
    verdict.add_argument("--requeue", action="store_true", help="exit 0 to requeue the job, 1 not to")
    verdict.add_argument(
        "--since", type=float, default=None, help="ignore verdicts written before this wall-clock time (date +%%s)"
    )
    verdict.set_defaults(fn=cmd_verdict)
