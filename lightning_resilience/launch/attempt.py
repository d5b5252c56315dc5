"""``python .../launch/attempt.py SPEC.json``: one attempt, run by torchrun itself.

The launcher starts this process once per attempt (``attempt.py SPEC``), or ahead of the attempt while the previous
one trains (``attempt.py --ahead FD``: it imports torchrun, then reads the spec's path from the pipe ``FD``; an empty
read means there is no next attempt). It sets the attempt's variables (the spec's ``env``), then calls
``torch.distributed.run.run`` (what the ``torchrun`` command runs) with the user's torchrun arguments,
``--max-restarts 0`` (restarts are the launcher's), and each worker wrapped by
:mod:`lightning_resilience.launch.worker`; then it writes what torchrun's elastic agent observed (each failed rank's
exit status or signal, its error file) to the outcome file the spec names. A new process per attempt means a new
agent and a new rendezvous store: no key of an earlier attempt can be read by a restarted worker. Once the outcome is
written the process ends at once (``os._exit``): the launcher waits for its end, not for the interpreter to tear
torch down.

Run as a file, with torch and the standard library only (no import of ours, hence none of Lightning).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["WORKER", "main", "torchrun_args", "worker_argv"]

WORKER = Path(__file__).resolve().with_name("worker.py")


def worker_argv(torchrun: Mapping[str, Any]) -> list[str]:
    """What the rank wrapper runs: ``[-m MODULE | SCRIPT, args...]``."""
    script = ["-m", torchrun["training_script"]] if torchrun.get("module") else [torchrun["training_script"]]
    return [*script, *torchrun["training_script_args"]]


def torchrun_args(spec: dict[str, Any]) -> argparse.Namespace:
    """torchrun's parsed arguments for this attempt: no in-agent restarts, workers wrapped for their end records."""
    args = argparse.Namespace(**spec["torchrun"])
    args.max_restarts = 0
    if not args.no_python and not args.run_path:  # a plain executable or an in-process function cannot be wrapped
        args.training_script_args = worker_argv(spec["torchrun"])
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

    args = sys.argv[1:] if argv is None else argv
    if args[0] == "--ahead":  # started while the previous attempt trains: the spec comes when this attempt starts
        with open(int(args[1])) as pipe:
            line = pipe.readline().strip()
        if not line:
            return 0
        args = [line]
    spec = json.loads(Path(args[0]).read_text())
    os.environ.update(spec.get("env") or {})
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
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)  # the outcome is written: torch's teardown is no part of the attempt
