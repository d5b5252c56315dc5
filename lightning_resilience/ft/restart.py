"""Restart awareness: which launcher started this attempt, its restart count, and fault notes left across restarts.

A rank that detects a fault (a hang, an exception, a preemption notice) leaves a small JSON *fault note* in the run
directory before it goes; rank 0 of the next attempt folds the notes into the ledger (:mod:`.ettr`). A rank that
dies without notice (SIGKILL, OOM killer, node loss) leaves none, which is itself the diagnosis.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from lightning_resilience.rundir import RunDir

__all__ = [
    "ATTEMPT_ENV",
    "Attempt",
    "FaultNote",
    "atomic_write_json",
    "atomic_write_text",
    "current_attempt",
    "read_fault_notes",
    "write_fault_note",
]

log = logging.getLogger(__name__)

ATTEMPT_ENV = "LIGHTNING_RESILIENCE_ATTEMPT"
"""Set by ``lightning-resilience launch`` in every worker: the attempt's index across restarts (and requeues)."""


@dataclass(frozen=True)
class Attempt:
    """How this process was launched."""

    launcher: str
    """'lightning-resilience', 'ft_launcher', 'torchrun', 'slurm' or 'none'."""
    restart_count: int
    """Attempts before this one: ``lightning-resilience launch``'s attempt index (it continues across requeues of
    the same run directory), else in-job restarts (TORCHELASTIC_RESTART_COUNT; 0 after a scheduler requeue)."""
    rank: int
    world_size: int
    job_id: str | None
    """Scheduler job id (SLURM_JOB_ID) or torchelastic run id, when known."""


def current_attempt(rank: int | None = None, world_size: int | None = None) -> Attempt:
    """Read the launcher's environment (torchrun, ft_launcher, Slurm) of this process."""
    env = os.environ
    launched = env.get(ATTEMPT_ENV)
    if launched is not None:  # our launcher runs torchrun once per attempt: its restart count is always 0
        launcher = "lightning-resilience"
    elif env.get("FT_RANK_MONITOR_IPC_SOCKET"):
        launcher = "ft_launcher"
    elif env.get("TORCHELASTIC_RUN_ID") is not None or env.get("TORCHELASTIC_RESTART_COUNT") is not None:
        launcher = "torchrun"
    elif env.get("SLURM_JOB_ID"):
        launcher = "slurm"
    else:
        launcher = "none"
    return Attempt(
        launcher=launcher,
        restart_count=int(launched or env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        rank=rank if rank is not None else int(env.get("RANK", "0")),
        world_size=world_size if world_size is not None else int(env.get("WORLD_SIZE", "1")),
        job_id=env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID"),
    )


@dataclass(frozen=True)
class FaultNote:
    """A fault one rank saw, left in ``<run_dir>/faults/`` for the next attempt's ledger."""

    kind: str
    """'hang', 'exception' or 'preemption'."""
    rank: int
    attempt: int
    """Restart count of the attempt that saw it."""
    step: int
    detected_at: float
    """Wall-clock seconds (time.time) when it was detected."""
    message: str = ""
    section: str | None = None
    detection_s: float | None = None
    """Seconds from the fault to its detection (a hang: how long the section had been stuck)."""
    timeout_s: float | None = None
    stacks: str | None = None
    """Stack dump of the rank, for a hang."""
    pid: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FaultNote:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def atomic_write_json(path: Path, data: Any, *, fsync: bool = True) -> None:
    """Write ``data`` as JSON to ``path`` so a reader sees the old file or the new one, never a torn one."""
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True), fsync=fsync)


def atomic_write_text(path: Path, text: str, *, fsync: bool = True) -> None:
    """Write ``text`` to ``path`` so a reader sees the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_fault_note(run_dir: Path, note: FaultNote) -> Path:
    """Leave ``note`` for the next attempt (one file per rank, attempt and kind; atomic)."""
    if not note.pid:
        note = FaultNote(**{**note.to_json(), "pid": os.getpid()})
    path = RunDir(run_dir).fault_note(note.attempt, note.rank, note.kind, note.pid)
    atomic_write_json(path, note.to_json())
    return path


def read_fault_notes(run_dir: Path, *, before: float | None = None, remove: bool = False) -> list[FaultNote]:
    """Notes in ``run_dir`` detected before ``before`` (wall clock), oldest first; ``remove`` consumes them."""
    notes: list[tuple[FaultNote, Path]] = []
    for path in RunDir(run_dir).fault_notes():
        try:
            note = FaultNote.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as err:
            log.warning("ignoring unreadable fault note %s: %s", path, err)
            continue
        if before is None or note.detected_at < before:
            notes.append((note, path))
    notes.sort(key=lambda item: item[0].detected_at)
    if remove:
        for _, path in notes:
            path.unlink(missing_ok=True)
    return [note for note, _ in notes]
