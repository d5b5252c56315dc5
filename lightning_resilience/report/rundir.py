"""What a run directory says about its attempts: the ledger, fault notes, stack dumps and launcher records, read
into the evidence of each attempt (:class:`.attribution.AttemptEvidence`), its attribution and the job's timeline.

Everything comes from files, so ``lightning-resilience report <run dir>`` explains a job after the fact, on any
machine. Every file is read where :class:`~lightning_resilience.rundir.RunDir` names it (the directory given, or
its ``resilience/`` folder when that is where the suite wrote): the ledger, the fault notes, the stack dumps, and
the records of ``lightning-resilience launch`` (one per node in a multi-node job). A launched attempt is matched
to the ledger's by time and attributed from the evidence the launcher attributed it from
(:func:`lightning_resilience.launch.analysis.evidence_of`), so both name the same culprit; one the ledger never
saw (it failed before its first step) is added from the launcher's record.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from lightning_resilience.attribution.engine import AttemptEvidence, Attribution, attribute
from lightning_resilience.ft.ettr import AttemptRecord
from lightning_resilience.ft.restart import FaultNote, read_fault_notes
from lightning_resilience.launch.analysis import evidence_of
from lightning_resilience.launch.records import AttemptRecord as LaunchedAttempt
from lightning_resilience.launch.records import read_records
from lightning_resilience.report.timeline import Timeline, build_timeline
from lightning_resilience.rundir import DEFAULT_SUBDIR, RunDir

__all__ = ["RunRecords", "explain_run", "find_ledger", "read_run"]

log = logging.getLogger(__name__)

_STACK_CAP = 256 * 1024  # bytes of a stack dump read (a dump of thousands of threads is cut)


@dataclass
class RunRecords:
    """The attempts of one run directory and the evidence of how each ended."""

    run_dir: Path
    ledger: Path | None
    attempts: list[AttemptRecord] = field(default_factory=list)
    evidence: list[AttemptEvidence] = field(default_factory=list)


def find_ledger(run_dir: str | Path) -> Path | None:
    """The ledger of attempts of ``run_dir`` (or of its ``resilience/`` folder), if any."""
    ledger = RunDir.locate(run_dir).ledger
    return ledger if ledger.is_file() else None


def read_run(run_dir: str | Path) -> RunRecords:
    """Read the attempts and their evidence; a run with neither a ledger nor launcher records has no attempts."""
    rd = RunDir.locate(run_dir)
    # the workers' records may sit in the suite's own folder beside the launcher's (a recipe's ``run_dir`` holds
    # ``launch/``, its fault tolerance writes to ``run_dir/resilience``)
    sub = RunDir(rd.root / DEFAULT_SUBDIR)
    suite = sub if not rd.ledger.is_file() and sub.ledger.is_file() else rd
    ledger = suite.ledger if suite.ledger.is_file() else None
    records = RunRecords(rd.root, ledger)
    if ledger is not None:
        try:
            data = json.loads(ledger.read_text())
            records.attempts = [AttemptRecord.from_json(a) for a in data.get("attempts", [])]
        except (OSError, ValueError, TypeError) as err:
            log.warning("ledger %s unreadable: %s", ledger, err)
    launched = _launched(rd)
    matched = _match(records.attempts, launched)
    # notes still in faults/: the last attempt's (the next attempt would have folded them into the ledger), or
    # written late, after the next attempt had started
    pending = read_fault_notes(suite.root)
    for i, rec in enumerate(records.attempts):
        launch = matched.get(i)
        if launch is not None:  # what the launcher attributed it from: the launcher and the report agree
            ev = evidence_of(launch, moved_to=rd.launch().attempt(launch.attempt))
            ev.attempt, ev.last_step = i, rec.last_step
            ev.world_size = rec.world_size or ev.world_size
            records.evidence.append(ev)
            continue
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
                text = _read_stacks(note.stacks, suite.stacks)
                if text is not None:
                    ev.stacks[note.rank] = text
        records.evidence.append(ev)
    return records


def _launched(rd: RunDir) -> list[LaunchedAttempt]:
    """The launcher's attempt records (every node's), merged per attempt index, oldest first."""
    merged: dict[int, LaunchedAttempt] = {}
    for launch in rd.launch_dirs():
        for rec in read_records(launch.root):
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
