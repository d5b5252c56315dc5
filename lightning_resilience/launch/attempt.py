"""``python .../launch/attempt.py SPEC.json``: one attempt, run by torchrun itself.

The launcher starts this process once per attempt. It calls ``torch.distributed.run.run`` (what the ``torchrun``
command runs) with the user's torchrun arguments, ``--max-restarts 0`` (restarts are the launcher's), and each worker
wrapped by :mod:`lightning_resilience.launch.worker`; then it writes what torchrun's elastic agent observed (each
failed rank's exit status or signal, its error file) to the outcome file the spec names. A new process per attempt
means a new agent and a new rendezvous store: no key of an earlier attempt can be read by a restarted worker.

Run as a file, with torch and the standard library only (no import of ours, hence none of Lightning).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["WORKER", "main", "torchrun_args"]

WORKER = Path(__file__).resolve().with_name("worker.py")


def torchrun_args(spec: dict[str, Any]) -> argparse.Namespace:
    """torchrun's parsed arguments for this attempt: no in-agent restarts, workers wrapped for their end records."""
    args = argparse.Namespace(**spec["torchrun"])
    args.max_restarts = 0
    if not args.no_python and not args.run_path:  # a plain executable or an in-process function cannot be wrapped
        script = ["-m", args.training_script] if args.module else [args.training_script]
        args.training_script_args = [*script, *args.training_script_args]
        args.training_script, args.module = str(WORKER), False
    return args


def _error_message(data: Any) -> tuple[str | None, str]:
    """``(exception type, message)`` from a torchelastic error file's JSON."""
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    if not isinstance(message, str) or not message:
        return None, ""
    head = message.split(":", 1)[0].strip()
    return (head if head.isidentifier() else None), message


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent  # run as a file, its folder leads sys.path: it is no place to import from
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != here]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    spec_path = Path((sys.argv[1:] if argv is None else argv)[0])
    spec = json.loads(spec_path.read_text())
    out = Path(spec["outcome"])
    outcome: dict[str, Any] = {"started_at": time.time(), "failures": {}, "error": None}
    status = 0
    try:
        run(torchrun_args(spec))
        outcome["result"] = "succeeded"
    except ChildFailedError as err:
        outcome["result"] = "failed"
        for rank, failure in err.failures.items():
            exc_type, message = _error_message(failure.error_file_data)
            outcome["failures"][str(rank)] = {
                "local_rank": failure.local_rank,
                "pid": failure.pid,
                "exitcode": failure.exitcode,
                "timestamp": failure.timestamp,
                "exception_type": exc_type,
                "message": message[:2000],
            }
        status = 1
    except BaseException as err:  # a rendezvous timeout, a signal to the agent (SignalException), a bad argument
        outcome["result"] = "launcher_error"
        outcome["error"] = f"{type(err).__name__}: {err}"
        outcome["traceback"] = traceback.format_exc()[-4000:]
        status = 1
    outcome["ended_at"] = time.time()
    out.write_text(json.dumps(outcome))  # read once this process has ended
    return status


if __name__ == "__main__":
    sys.exit(main())
