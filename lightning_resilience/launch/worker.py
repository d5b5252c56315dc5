"""``python .../launch/worker.py [-m MODULE | SCRIPT] [args]``: what torchrun starts on each rank under
``lightning-resilience launch``. Runs the user's script or module as ``__main__`` (as ``python SCRIPT`` would) and
records how the rank ended in the attempt's rank record (``RunDir.launch().rank_record``): start, then exit status or
uncaught exception with its time. The exception also goes to torchrun's ``TORCHELASTIC_ERROR_FILE`` (torch's own
``ErrorHandler``), so torchrun's failure summary shows the traceback. A rank ended by a signal leaves only its start.

Before the script runs it puts back torchrun's per-attempt contract, which the launcher's one-torchrun-per-attempt
would otherwise break: ``TORCHELASTIC_RESTART_COUNT`` (the attempt of this launch), ``TORCHELASTIC_MAX_RESTARTS``
(``--max-restarts``) and ``TORCHELASTIC_RUN_ID`` (the same on every attempt), as the launcher passes them.

Run as a file, and standard library only until the user's script runs: a rank pays no import of ours.
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

__all__ = ["ATTEMPT_ENV", "RANK_RECORD_ENV", "TORCHELASTIC_ENV", "apply_torchelastic_env", "main", "read_rank_record"]

# the name lightning_resilience.ft.restart reads (this file imports nothing of ours; a test keeps them equal)
ATTEMPT_ENV = "LIGHTNING_RESILIENCE_ATTEMPT"
RANK_RECORD_ENV = "LIGHTNING_RESILIENCE_RANK_RECORD"
"""The path of this attempt's rank records, ``{rank}`` to be filled in (set by the launcher)."""
TORCHELASTIC_ENV = "LIGHTNING_RESILIENCE_TORCHELASTIC_ENV"
"""JSON of the ``TORCHELASTIC_*`` values torchrun would give this attempt (set by the launcher)."""


def apply_torchelastic_env(environ: MutableMapping[str, str] | None = None) -> None:
    """Put the launcher's ``TORCHELASTIC_*`` values for this attempt into ``environ`` (``os.environ``)."""
    env = os.environ if environ is None else environ
    try:
        values = json.loads(env.get(TORCHELASTIC_ENV) or "{}")
    except ValueError:
        return
    for name, value in values.items():
        if name.startswith("TORCHELASTIC_"):
            env[name] = str(value)


class _RankRecord:
    def __init__(self) -> None:
        template = os.environ.get(RANK_RECORD_ENV)
        rank = int(os.environ.get("RANK", "0"))
        self.path = Path(template.format(rank=rank)) if template else None
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
    apply_torchelastic_env()
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


def read_rank_record(path: Path) -> dict[str, Any] | None:
    """A rank record, or None when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
        int(data["rank"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return data if isinstance(data, dict) else None


if __name__ == "__main__":
    main()
