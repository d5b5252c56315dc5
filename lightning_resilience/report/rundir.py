"""What a run directory says about its attempts: the ledger, fault notes, stack dumps and launcher records, read
into the evidence of each attempt (:class:`.attribution.AttemptEvidence`), its attribution and the job's timeline.

Everything comes from files, so ``lightning-resilience report <run dir>`` explains a job after the fact, on any
machine. The ledger (``ft_ledger.json``) is looked for in the run directory, then in its ``resilience/`` and
``ft/`` folders; fault notes (``faults/``) and stack dumps (``stacks/``) sit next to it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from lightning_resilience.ft.ettr import LEDGER_FILE, AttemptRecord
from lightning_resilience.ft.restart import FAULTS_DIR, FaultNote, read_fault_notes
from lightning_resilience.report.attribution import AttemptEvidence, Attribution, attribute
from lightning_resilience.report.timeline import Timeline, build_timeline

__all__ = ["RunRecords", "explain_run", "find_ledger", "read_run"]

log = logging.getLogger(__name__)

_LEDGER_DIRS = ("", "resilience", "ft")
_STACKS_DIR = "stacks"
_STACK_CAP = 256 * 1024  # bytes of a stack dump read (a dump of thousands of threads is cut)


@dataclass
class RunRecords:
    """The attempts of one run directory and the evidence of how each ended."""

    run_dir: Path
    ledger: Path | None
    attempts: list[AttemptRecord] = field(default_factory=list)
    evidence: list[AttemptEvidence] = field(default_factory=list)


def find_ledger(run_dir: str | Path) -> Path | None:
    """The ledger of attempts under ``run_dir`` (the directory itself, ``resilience/`` or ``ft/``), if any."""
    root = Path(run_dir)
    for sub in _LEDGER_DIRS:
        path = root / sub / LEDGER_FILE if sub else root / LEDGER_FILE
        if path.is_file():
            return path
    return None


def read_run(run_dir: str | Path) -> RunRecords:
    """Read the attempts and their evidence; a run without a ledger has no attempts (nothing fails)."""
    root = Path(run_dir)
    ledger = find_ledger(root)
    records = RunRecords(root, ledger)
    if ledger is None:
        return records
    try:
        data = json.loads(ledger.read_text())
        records.attempts = [AttemptRecord.from_json(a) for a in data.get("attempts", [])]
    except (OSError, ValueError, TypeError) as err:
        log.warning("ledger %s unreadable: %s", ledger, err)
        return records
    folder = ledger.parent
    # notes still in faults/: the last attempt's (the next attempt would have folded them into the ledger), or
    # written late, after the next attempt had started
    pending = read_fault_notes(folder) if (folder / FAULTS_DIR).is_dir() else []
    for i, rec in enumerate(records.attempts):
        until = records.attempts[i + 1].started_at if i + 1 < len(records.attempts) else float("inf")
        notes = [FaultNote.from_json(f) for f in rec.faults if isinstance(f, dict)]
        notes += [n for n in pending if rec.started_at <= n.detected_at < until]
        ev = AttemptEvidence(
            attempt=i,
            world_size=rec.world_size,
            end_reason=rec.end_reason,
            started_at=rec.started_at,
            ended_at=rec.ended_at,
            last_step=rec.last_step,
            notes=_dedupe(notes),
        )
        for note in ev.notes:
            if note.stacks and note.rank not in ev.stacks:
                text = _read_stacks(folder, note.stacks)
                if text is not None:
                    ev.stacks[note.rank] = text
        records.evidence.append(ev)
    return records


def _dedupe(notes: list[FaultNote]) -> list[FaultNote]:
    seen: set[tuple[int, str, float]] = set()
    out = []
    for note in notes:
        key = (note.rank, note.kind, note.detected_at)
        if key not in seen:
            seen.add(key)
            out.append(note)
    return out


def _read_stacks(folder: Path, recorded: str) -> str | None:
    """The stack dump a note points to; when the run directory moved, the file of that name in its ``stacks/``."""
    for path in (Path(recorded), folder / _STACKS_DIR / Path(recorded).name):
        try:
            with open(path, errors="replace") as f:
                return f.read(_STACK_CAP)
        except OSError:
            continue
    return None


def explain_run(
    run_dir: str | Path, *, current_attempt: str | None = None
) -> tuple[RunRecords, list[Attribution], Timeline | None]:
    """The attempts of ``run_dir``, why each ended, and the job's timeline (None without a ledger).

    ``current_attempt``: the end reason of the newest attempt when the ledger does not record one yet.
    """
    records = read_run(run_dir)
    if current_attempt is not None and records.evidence and records.evidence[-1].end_reason is None:
        records.evidence[-1].end_reason = current_attempt
    attributions = [attribute(ev) for ev in records.evidence]
    timeline = build_timeline(records.attempts, attributions) if records.attempts else None
    return records, attributions, timeline
