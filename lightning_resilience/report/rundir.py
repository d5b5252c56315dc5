"""What a run directory says about its attempts: the ledger, fault notes, stack dumps and launcher records, read
into the evidence of each attempt (:class:`.attribution.AttemptEvidence`), its attribution and the job's timeline.

Everything comes from files, so ``lightning-resilience report <run dir>`` explains a job after the fact, on any
machine. The ledger (``ft_ledger.json``) is looked for in the run directory, then in its ``resilience/`` and
``ft/`` folders; fault notes (``faults/``) and stack dumps (``stacks/``) sit next to it. The records of
``lightning-resilience launch`` (``launch/attempts.jsonl``, one per node in a multi-node job) add how every rank's
process ended: its exit code or signal, when, the exception it raised. A launched attempt is matched to the
ledger's by time; one the ledger never saw (it failed before its first step) is added from the launcher's record.
"""

from __future__ import annotations

import json
import logging
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from lightning_resilience.ft.ettr import LEDGER_FILE, AttemptRecord
from lightning_resilience.ft.restart import FAULTS_DIR, FaultNote, read_fault_notes
from lightning_resilience.launch.records import RECORDS_FILE, read_records
from lightning_resilience.launch.records import AttemptRecord as LaunchedAttempt
from lightning_resilience.report.attribution import AttemptEvidence, Attribution, RankExit, attribute
from lightning_resilience.report.timeline import Timeline, build_timeline

__all__ = ["RunRecords", "explain_run", "find_ledger", "read_run"]

log = logging.getLogger(__name__)

_LEDGER_DIRS = ("", "resilience", "ft")
_STACKS_DIR = "stacks"
_STACK_CAP = 256 * 1024  # bytes of a stack dump read (a dump of thousands of threads is cut)
_DUMP_RANK = re.compile(r"rank(\d+)")


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
    """Read the attempts and their evidence; a run with neither a ledger nor launcher records has no attempts."""
    root = Path(run_dir)
    ledger = find_ledger(root)
    records = RunRecords(root, ledger)
    if ledger is not None:
        try:
            data = json.loads(ledger.read_text())
            records.attempts = [AttemptRecord.from_json(a) for a in data.get("attempts", [])]
        except (OSError, ValueError, TypeError) as err:
            log.warning("ledger %s unreadable: %s", ledger, err)
    launched = _launched(root, ledger)
    matched = _match(records.attempts, launched)
    folder = ledger.parent if ledger is not None else root
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
        launch = matched.get(i)
        if launch is not None:
            _add_launch_evidence(ev, launch, root / "launch" / f"attempt_{launch.attempt}")
        for note in ev.notes:
            if note.stacks and note.rank not in ev.stacks:
                text = _read_stacks(note.stacks, folder / _STACKS_DIR)
                if text is not None:
                    ev.stacks[note.rank] = text
        records.evidence.append(ev)
    return records


def _launched(root: Path, ledger: Path | None) -> list[LaunchedAttempt]:
    """The launcher's attempt records (every node's file), merged per attempt index, oldest first."""
    bases = [root] + ([ledger.parent, ledger.parent.parent] if ledger is not None else [])
    files: list[Path] = []
    for base in dict.fromkeys(bases):
        folder = base / "launch"
        files += [p.parent for p in sorted([folder / RECORDS_FILE, *folder.glob(f"*/{RECORDS_FILE}")]) if p.is_file()]
        if files:
            break
    merged: dict[int, LaunchedAttempt] = {}
    for folder in files:
        for rec in read_records(folder):
            if not isinstance(rec, LaunchedAttempt):
                continue
            seen = merged.get(rec.attempt)
            if seen is None:
                merged[rec.attempt] = rec
            else:  # another node's view of the same attempt
                seen.ranks += rec.ranks
                seen.fault_notes += rec.fault_notes
                seen.hang_dumps += rec.hang_dumps
                seen.started_at, seen.ended_at = min(seen.started_at, rec.started_at), max(seen.ended_at, rec.ended_at)
    return sorted(merged.values(), key=lambda r: r.started_at)


def _match(attempts: list[AttemptRecord], launched: list[LaunchedAttempt]) -> dict[int, LaunchedAttempt]:
    """Ledger attempt index -> the launched attempt it ran in (its start inside the launch's span); launched attempts
    the ledger never saw become ledger attempts of their own (no steps), so every attempt is explained."""
    out: dict[int, LaunchedAttempt] = {}
    orphans = []
    for launch in launched:
        hit = next(
            (
                i
                for i, a in enumerate(attempts)
                if i not in out and launch.started_at - 1.0 <= a.started_at <= launch.ended_at + 1.0
            ),
            None,
        )
        if hit is None:
            orphans.append(launch)
        else:
            out[hit] = launch
    if orphans:
        pairs = [(a, out.get(i)) for i, a in enumerate(attempts)]
        for launch in orphans:
            pairs.append((_from_launch(launch), launch))
        pairs.sort(key=lambda p: p[0].started_at)
        attempts[:] = [a for a, _ in pairs]
        for i, a in enumerate(attempts):
            a.index = i
        out = {i: launch for i, (_, launch) in enumerate(pairs) if launch is not None}
    return out


def _from_launch(launch: LaunchedAttempt) -> AttemptRecord:
    ended = "finished" if launch.outcome == "succeeded" else "lost"
    return AttemptRecord(
        index=-1,
        restart_count=launch.attempt,
        launcher="lightning-resilience",
        world_size=len(launch.ranks),
        started_at=launch.started_at,
        ended_at=launch.ended_at,
        end_reason=ended,
    )


def _add_launch_evidence(ev: AttemptEvidence, launch: LaunchedAttempt, dumps: Path) -> None:
    """How each rank's process ended, the notes and stack dumps the launcher collected, and the attempt's end."""
    for end in launch.ranks:
        exception = end.exception or {}
        text = f"{exception.get('type', 'Exception')}: {exception.get('message', '')}" if end.exception else None
        ev.exits[end.rank] = RankExit(
            end.rank,
            exit_code=end.exit_code,
            signal=_signal_number(end.signal),
            exited_at=end.ended_at,
            exception=text,
            stopped_by_launcher=end.stopped_by_launcher,
        )
    if ev.world_size is None:
        ev.world_size = len(launch.ranks)
    ev.ended_at = launch.ended_at
    known = {(n.rank, n.kind, n.detected_at) for n in ev.notes}
    for data in launch.fault_notes:
        try:
            note = FaultNote.from_json({"attempt": launch.attempt, **data})
        except (TypeError, ValueError):
            continue
        if (note.rank, note.kind, note.detected_at) not in known and isinstance(note.detected_at, int | float):
            ev.notes.append(note)
    for dump in launch.hang_dumps:
        match = _DUMP_RANK.search(Path(dump).name)
        if match is not None and int(match.group(1)) not in ev.stacks:
            text = _read_stacks(dump, dumps)
            if text is not None:
                ev.stacks[int(match.group(1))] = text


def _signal_number(name: str | None) -> int | None:
    if name is None:
        return None
    try:
        return int(signal.Signals[name])
    except KeyError:
        digits = re.sub(r"\D", "", name)
        return int(digits) if digits else None


def _dedupe(notes: list[FaultNote]) -> list[FaultNote]:
    seen: set[tuple[int, str, float]] = set()
    out = []
    for note in notes:
        key = (note.rank, note.kind, note.detected_at)
        if key not in seen:
            seen.add(key)
            out.append(note)
    return out


def _read_stacks(recorded: str, *moved: Path) -> str | None:
    """The stack dump a record points to; when the run directory moved, the file of that name in ``moved``."""
    for path in (Path(recorded), *(folder / Path(recorded).name for folder in moved)):
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
