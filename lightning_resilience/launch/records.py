"""The launcher's records: one JSON line per launch and per attempt in ``<run_dir>/launch/attempts.jsonl``.

The format is versioned (:data:`SCHEMA`) and documented in docs/launching.md; readers skip lines of another
schema or kind. Each attempt names every rank's end (exit code, signal, exception type) and the *cause*: the rank that
failed first and how, told apart from the ranks that failed because of it (a peer's gloo "Connection closed" after
that peer was SIGKILLed is a victim, not the culprit).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from lightning_resilience.exit_codes import ExitCode
from lightning_resilience.rundir import LaunchDir

__all__ = [
    "RECORDS_FILE",
    "SCHEMA",
    "AttemptRecord",
    "Cause",
    "LaunchRecord",
    "RankEnd",
    "append_record",
    "read_records",
]

log = logging.getLogger(__name__)

SCHEMA = 1
"""Version of the record format; a reader of version N reads lines with ``"schema": N`` only."""
RECORDS_FILE = LaunchDir(Path()).attempts.name

_VERDICTS = {int(code): code.name.lower() for code in ExitCode if code != ExitCode.OK}


@dataclass
class RankEnd:
    """How one rank of an attempt ended."""

    rank: int
    """Global rank."""
    local_rank: int | None = None
    pid: int | None = None
    host: str | None = None
    exit_code: int | None = None
    """Exit status: the one the rank asked for (its own record: ``sys.exit``, an uncaught exception is 1) or, without
    one, the one torchrun observed; None when a signal ended it first or nothing was observed."""
    signal: str | None = None
    """Name of the signal that ended it before it could record its end (``SIGKILL``: the OOM killer, a drill)."""
    teardown_signal: str | None = None
    """A signal that ended the process *after* it recorded its end: an abort in interpreter teardown (a gloo thread
    that lost its peer), or torchrun's SIGTERM to a rank already on its way out. Not the cause of anything."""
    stopped_by_launcher: bool = False
    """Ended by torchrun's agent (SIGTERM, then SIGKILL) after another rank failed: its own end was not observed."""
    exception: dict[str, str] | None = None
    """``{"type": "RuntimeError", "message": "..."}`` of an uncaught exception, when the rank recorded one."""
    ended_at: float | None = None
    """Wall clock (time.time) of the end: the rank's own record, else when torchrun's agent observed it."""
    role: str = "ok"
    """'ok' (exit 0), 'culprit' (see :class:`Cause`), 'victim' (failed because of the culprit), 'agreed' (ended
    together with the others by the job's decision: a preemption, an SDC stop) or 'stopped' (by torchrun)."""

    @property
    def failed(self) -> bool:
        return self.signal is not None or (self.exit_code is not None and self.exit_code != 0)

    def how(self) -> tuple[str, str]:
        """``(kind, detail)``: ('signal', 'SIGKILL'), ('verdict', 'hang'), ('exception', 'ValueError'), ('exit', '3')"""
        if self.signal is not None:
            return "signal", self.signal
        if self.exit_code in _VERDICTS:
            return "verdict", _VERDICTS[int(self.exit_code)]
        if self.exception is not None:
            return "exception", self.exception.get("type", "Exception")
        return "exit", str(self.exit_code)


@dataclass
class Cause:
    """The rank whose failure ended the attempt, and how."""

    rank: int | None
    """None when no single rank can be named (the same failure on every rank, a decision of the whole job)."""
    kind: str
    """'signal', 'verdict' (one of our exit codes), 'exception', 'exit' (a non-zero status and nothing else) or
    'lost' (no rank left a trace)."""
    detail: str
    """The signal name, the verdict (``hang``, ``preempted``...), the exception type, or the exit status."""
    message: str = ""
    exit_code: int | None = None


def signal_name(exit_status: int) -> str | None:
    """``SIGKILL`` for a negative (Popen) status of -9; None for a normal exit status."""
    if exit_status >= 0:
        return None
    try:
        return signal.Signals(-exit_status).name
    except ValueError:
        return f"signal {-exit_status}"


@dataclass
class LaunchRecord:
    """What was launched (first line of each ``lightning-resilience launch`` invocation)."""

    launch_id: str
    started_at: float
    argv: list[str]
    run_dir: str
    max_restarts: int
    max_no_progress_restarts: int
    nproc_per_node: int
    nnodes: str
    rdzv_backend: str
    host: str
    pid: int
    first_attempt: int
    """Index of this launch's first attempt (a requeued job continues the numbering of the run directory)."""
    run_id: str = ""
    """The run id every attempt's workers see as ``TORCHELASTIC_RUN_ID``."""
    schema: int = SCHEMA
    kind: str = "launch"


@dataclass
class AttemptRecord:
    """One attempt: one torchrun (elastic agent) run of the script on this node."""

    launch_id: str
    attempt: int
    started_at: float
    ended_at: float
    outcome: str
    """'succeeded', 'failed', 'interrupted' (the launcher was signalled) or 'launcher_error' (torchrun itself failed
    before or around its workers, e.g. a rendezvous timeout)."""
    agent_exit_code: int
    """Exit status of the torchrun process of this attempt."""
    ranks: list[RankEnd]
    cause: Cause | None
    step_at_start: int | None
    """Newest committed step when the attempt started (None: none yet)."""
    step_at_end: int | None
    progress: bool
    """A newer step was committed during the attempt."""
    no_progress_count: int
    """Consecutive attempts, this one included, that ended without progress (0 after one that made progress)."""
    decision: str
    """'done', 'restart' or 'stop'."""
    exit_code: int | None
    """The launcher's exit status when ``decision`` is 'done' or 'stop'."""
    reason: str
    hang_dumps: list[str] = field(default_factory=list)
    """Stack dumps of hung ranks, copied into ``launch/attempt_<n>/``."""
    fault_notes: list[dict[str, Any]] = field(default_factory=list)
    """Fault notes ranks left for this attempt (kind, rank, step, message, section)."""
    agent_error: str | None = None
    progress_known: bool = True
    """Some source says what the job committed (the ranks' progress records, an iteration file); without one the
    launcher cannot tell progress and never stops for the lack of it."""
    schema: int = SCHEMA
    kind: str = "attempt"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttemptRecord:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["ranks"] = [RankEnd(**r) for r in data.get("ranks", [])]
        values["cause"] = Cause(**data["cause"]) if data.get("cause") else None
        return cls(**values)


def append_record(launch_dir: Path, record: LaunchRecord | AttemptRecord) -> None:
    """Append one line (flushed and fsynced: a launcher killed right after still leaves whole lines)."""
    path = LaunchDir(launch_dir).attempts
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(asdict(record), sort_keys=True)
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(launch_dir: Path) -> Iterator[LaunchRecord | AttemptRecord]:
    """The records of this schema, oldest first; a torn or foreign line is skipped with a warning."""
    path = LaunchDir(launch_dir).attempts
    if not path.is_file():
        return
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            if data.get("schema") != SCHEMA:
                continue
            if data.get("kind") == "attempt":
                yield AttemptRecord.from_json(data)
            elif data.get("kind") == "launch":
                known = {f.name for f in fields(LaunchRecord)}
                yield LaunchRecord(**{k: v for k, v in data.items() if k in known})
        except (ValueError, TypeError, KeyError) as err:
            log.warning("%s line %d: skipped (%s)", path, n, err)
