"""``python .../launch/worker.py [-m MODULE | SCRIPT] [args]``: what torchrun starts on each rank under
``lightning-resilience launch``. Runs the user's script or module as ``__main__`` (as ``python SCRIPT`` would) and
records how the rank ended in ``<run_dir>/launch/attempt_<n>/rank_<r>.json``: start, then exit status or uncaught
exception with its time. The exception also goes to torchrun's ``TORCHELASTIC_ERROR_FILE`` (torch's own
``ErrorHandler``), so torchrun's failure summary shows the traceback. A rank ended by a signal leaves only its start.

Run as a file, and standard library only until the user's script runs: a rank pays no import of ours.
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["ATTEMPT_ENV", "LAUNCH_DIR_ENV", "attempt_dir", "main", "rank_file", "read_rank_records"]

# the names lightning_resilience.ft.restart reads (this file imports nothing of ours; a test keeps them equal)
ATTEMPT_ENV = "LIGHTNING_RESILIENCE_ATTEMPT"
LAUNCH_DIR_ENV = "LIGHTNING_RESILIENCE_LAUNCH_DIR"


def attempt_dir(launch_dir: Path, attempt: int) -> Path:
    """Where one attempt's files go."""
    return launch_dir / f"attempt_{attempt:04d}"


def rank_file(launch_dir: Path, attempt: int, rank: int) -> Path:
    return attempt_dir(launch_dir, attempt) / f"rank_{rank:05d}.json"


class _RankRecord:
    def __init__(self) -> None:
        launch_dir, attempt = os.environ.get(LAUNCH_DIR_ENV), os.environ.get(ATTEMPT_ENV)
        rank = int(os.environ.get("RANK", "0"))
        self.path = rank_file(Path(launch_dir), int(attempt), rank) if launch_dir and attempt else None
        self.data: dict[str, Any] = {
            "rank": rank,
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": time.time(),
        }

    def write(self, **end: Any) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps({**self.data, **end}))
            os.replace(tmp, self.path)  # a rank killed while writing leaves the previous record whole
        except OSError as err:  # the record is for the report; the training run must not fail for it
            print(f"lightning-resilience: cannot write {self.path}: {err}", file=sys.stderr)


def _described(err: BaseException) -> dict[str, str]:
    return {"type": type(err).__name__, "message": str(err)[:2000]}


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 1  # sys.exit("message") prints it and exits 1


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or (argv[:1] == ["-m"] and len(argv) < 2):
        raise SystemExit("usage: worker.py [-m MODULE | SCRIPT] [args...]")
    record = _RankRecord()
    record.write()
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()  # as `python -m MODULE` has it (this file's folder is no place to import from)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` has it
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        status = _exit_status(exit_.code)
        # an app that turns an exception into sys.exit(1) (Hydra's @hydra.main does) exits while handling it
        context = exit_.__context__ if status else None
        cause = _described(context) if isinstance(context, Exception) else None
        record.write(exit_code=status, ended_at=time.time(), **({"exception": cause} if cause else {}))
        raise
    except BaseException as err:
        record.write(exit_code=1, ended_at=time.time(), exception=_described(err))
        if isinstance(err, Exception):
            from torch.distributed.elastic.multiprocessing.errors import get_error_handler

            get_error_handler().record_exception(err)
        raise
    record.write(exit_code=0, ended_at=time.time())


def read_rank_records(directory: Path) -> dict[int, dict[str, Any]]:
    """``rank -> record`` of every rank that started in an attempt directory."""
    out: dict[int, dict[str, Any]] = {}
    for path in sorted(directory.glob("rank_*.json")):
        try:
            data = json.loads(path.read_text())
            out[int(data["rank"])] = data
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


if __name__ == "__main__":
    main()
