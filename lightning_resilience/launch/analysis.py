"""After an attempt: how each rank ended, what the ranks left (fault notes, stack dumps), and who ended it.

Everything is read from the run directory at the paths :class:`~lightning_resilience.rundir.RunDir` names: what
torchrun's agent observed (``outcome.json``), each rank's own record, the fault notes and the ledger of the attempt,
the stack dumps of hung ranks. The culprit and the victims come from the one attribution engine of the suite
(:func:`lightning_resilience.attribution.engine.attribute`), fed by :func:`evidence`; ``lightning-resilience report``
feeds it the same evidence from the attempt's record, so the launcher and the report name the same culprit.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_resilience.attribution.engine import AttemptEvidence, Attribution, FailureKind, RankExit, attribute
from lightning_resilience.exit_codes import ExitCode
from lightning_resilience.ft.restart import FaultNote
from lightning_resilience.launch.records import AttemptRecord, Cause, RankEnd, signal_name
from lightning_resilience.launch.worker import read_rank_record
from lightning_resilience.rundir import LaunchDir, RunDir

__all__ = ["AttemptEnd", "analyse", "evidence", "evidence_of", "name_culprit", "summary"]

log = logging.getLogger(__name__)

_NOTE_FIELDS = ("kind", "rank", "step", "detected_at", "message", "section", "detection_s", "stacks")
_VERDICTS = {int(code): code.name.lower() for code in ExitCode if code != ExitCode.OK}
_KIND_VERDICTS = {
    FailureKind.HANG: ExitCode.HANG,
    FailureKind.PREEMPTION: ExitCode.PREEMPTED,
    FailureKind.SDC: ExitCode.SDC,
    FailureKind.STRAGGLER: ExitCode.STRAGGLER,
    FailureKind.NO_PROGRESS: ExitCode.NO_PROGRESS,
}


@dataclass
class AttemptEnd:
    """How one attempt ended, as the launcher records it."""

    succeeded: bool
    result: str
    """'succeeded', 'failed' or 'launcher_error' (torchrun's agent itself failed)."""
    ranks: list[RankEnd]
    cause: Cause | None
    fault_notes: list[dict[str, Any]] = field(default_factory=list)
    hang_dumps: list[str] = field(default_factory=list)
    agent_error: str | None = None


def analyse(run_dir: RunDir, launch: LaunchDir, attempt: int, *, nproc_per_node: int) -> AttemptEnd:
    """Read what attempt ``attempt`` left in the run directory, copy its stack dumps, and name its culprit."""
    outcome = _read_json(launch.outcome(attempt)) or {"result": "launcher_error", "failures": {}}
    records = {r: rec for r, path in launch.rank_records(attempt).items() if (rec := read_rank_record(path))}
    ranks = rank_ends(outcome, records)
    notes = fault_notes(run_dir, attempt)
    dumps = _collect_dumps(run_dir, launch, attempt, sorted({r.rank for r in ranks} | {n["rank"] for n in notes}))
    # every rank finished (its own record says exit 0), even if one then aborted in interpreter teardown
    finished = len(ranks) >= nproc_per_node and all(r.exit_code == 0 and not r.signal for r in ranks)
    succeeded = outcome.get("result") == "succeeded" or finished
    cause = None
    if not succeeded:
        cause = name_culprit(ranks, evidence(attempt, ranks, notes, _stacks(dumps), succeeded=False))
    result = "succeeded" if succeeded else str(outcome.get("result", "launcher_error"))
    return AttemptEnd(succeeded, result, ranks, cause, notes, [str(p) for p in dumps], outcome.get("error"))


# ------------------------------------------------------------------------------------------------ evidence
def evidence(
    attempt: int,
    ranks: list[RankEnd],
    notes: list[dict[str, Any]],
    stacks: dict[int, str],
    *,
    succeeded: bool,
    started_at: float | None = None,
    ended_at: float | None = None,
) -> AttemptEvidence:
    """What the attribution engine reads about a launched attempt: each rank's end, the notes, the stack dumps."""
    ev = AttemptEvidence(
        attempt=attempt,
        world_size=len(ranks) or None,
        end_reason="finished" if succeeded else "lost",
        started_at=started_at,
        ended_at=ended_at,
    )
    for end in ranks:
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
    for data in notes:
        try:
            note = FaultNote.from_json({"attempt": attempt, **data})
        except (TypeError, ValueError):
            continue
        if isinstance(note.rank, int) and isinstance(note.detected_at, int | float):
            ev.notes.append(note)
    ev.stacks.update(stacks)
    return ev


def evidence_of(record: AttemptRecord, moved_to: Path | None = None) -> AttemptEvidence:
    """The evidence the launcher attributed ``record`` from, read back from the record (and its stack dumps; when
    the run directory moved, from the same names under ``moved_to``)."""
    stacks: dict[int, str] = {}
    for dump in record.hang_dumps:
        rank = _dump_rank(Path(dump).name)
        text = _read_text(Path(dump)) if rank is not None else None
        if text is None and rank is not None and moved_to is not None:
            text = _read_text(moved_to / Path(dump).name)
        if rank is not None and text is not None:
            stacks[rank] = text
    return evidence(
        record.attempt,
        record.ranks,
        record.fault_notes,
        stacks,
        succeeded=record.outcome == "succeeded",
        started_at=record.started_at,
        ended_at=record.ended_at,
    )


def name_culprit(ranks: list[RankEnd], ev: AttemptEvidence) -> Cause | None:
    """The engine's verdict on ``ev`` as the launcher records it: the :class:`Cause`, and each rank's ``role``."""
    found = attribute(ev)
    for r in ranks:
        r.role = "stopped" if r.stopped_by_launcher else ("agreed" if r.failed else "ok")
    if found.cause is None:
        return None
    victims = {v.rank for v in found.victims}
    for r in ranks:
        if r.rank in victims:
            r.role = "victim"
    by_rank = {r.rank: r for r in ranks}
    culprit = found.cause
    end = by_rank.get(culprit.rank) if culprit.rank is not None else None
    if end is not None:
        end.role = "culprit"
    elif culprit.rank is None:  # no single rank: every rank that failed this way shares it
        for r in ranks:
            if r.role == "agreed":
                r.role = "culprit"
    kind, detail, code = _how(found, end, ranks)
    message = (end.exception or {}).get("message", "") if end is not None else culprit.detail
    return Cause(rank=culprit.rank, kind=kind, detail=detail, message=message[:500], exit_code=code)


def _how(found: Attribution, end: RankEnd | None, ranks: list[RankEnd]) -> tuple[str, str, int | None]:
    """``(kind, detail, exit code)`` in the launcher's words: signal / verdict / exception / exit / lost."""
    assert found.cause is not None
    kind = found.cause.kind
    codes = Counter(r.exit_code for r in ranks if r.failed and r.exit_code not in (None, 0))
    code = end.exit_code if end is not None else (codes.most_common(1)[0][0] if codes else None)
    if kind in _KIND_VERDICTS:
        verdict = _KIND_VERDICTS[kind]
        return "verdict", _VERDICTS[int(verdict)], code if code is not None else int(verdict)
    if kind is FailureKind.SIGNAL:
        return "signal", (end.signal if end is not None and end.signal else found.cause.detail), code
    if kind is FailureKind.EXCEPTION:
        exc = (end.exception or {}).get("type") if end is not None else None
        return "exception", exc or found.cause.detail.split(":", 1)[0], code
    if kind is FailureKind.LOST:
        return "lost", found.cause.detail, code
    if code in _VERDICTS:
        return "verdict", _VERDICTS[int(code)], code
    return "exit", str(code), code


# ------------------------------------------------------------------------------------------------ rank ends
def rank_ends(outcome: dict[str, Any], records: dict[int, dict[str, Any]]) -> list[RankEnd]:
    """Merge what torchrun's agent observed (authoritative exit status or signal) with each rank's own record."""
    failures = {int(k): v for k, v in outcome.get("failures", {}).items()}
    succeeded = outcome.get("result") == "succeeded"
    ends = []
    for rank in sorted(set(failures) | set(records)):
        own, seen = records.get(rank, {}), failures.get(rank)
        end = RankEnd(rank=rank, local_rank=own.get("local_rank"), pid=own.get("pid"), host=own.get("host"))
        end.exception = own.get("exception")
        end.ended_at = own.get("ended_at")
        if seen is not None:
            status = int(seen["exitcode"])
            if "exit_code" in own:  # it recorded its end: a signal seen after that came during teardown
                end.exit_code, end.teardown_signal = int(own["exit_code"]), signal_name(status)
            else:
                end.signal, end.exit_code = signal_name(status), (status if status >= 0 else None)
            end.local_rank = seen.get("local_rank", end.local_rank)
            end.pid = end.pid or seen.get("pid")  # the process that ran the script (torchrun's may stand in for it)
            if end.exception is None and seen.get("exception_type"):
                end.exception = {"type": seen["exception_type"], "message": seen.get("message", "")}
            if end.ended_at is None:
                end.ended_at = float(seen.get("timestamp") or 0) or None
        elif "exit_code" in own:
            end.exit_code = int(own["exit_code"])
        elif succeeded:
            end.exit_code = 0
        else:
            end.stopped_by_launcher = True
        ends.append(end)
    return ends


# ------------------------------------------------------------------------------------------------ collection
def fault_notes(run_dir: RunDir, attempt: int) -> list[dict[str, Any]]:
    """The notes ranks left for an attempt: in ``faults/`` (other ranks) and in the ETTR ledger (rank 0's, and the
    others' once a later attempt folded them in), oldest first, each once."""
    found: list[dict[str, Any]] = [d for path in run_dir.fault_notes(attempt) if (d := _read_json(path))]
    for entry in (_read_json(run_dir.ledger) or {}).get("attempts", []):
        if isinstance(entry, dict) and entry.get("restart_count") == attempt:
            found.extend(f for f in entry.get("faults", []) if isinstance(f, dict))
    notes: dict[tuple[Any, ...], dict[str, Any]] = {}
    for data in found:
        note = {k: data.get(k) for k in _NOTE_FIELDS}
        notes.setdefault((note["kind"], note["rank"], note["step"], note["detected_at"]), note)
    return sorted(notes.values(), key=lambda n: n["detected_at"] or 0.0)


def _collect_dumps(run_dir: RunDir, launch: LaunchDir, attempt: int, ranks: list[int]) -> list[Path]:
    """Copy the stack dumps hung ranks wrote for this attempt next to the attempt's records."""
    copied = []
    for rank in ranks:
        dump = run_dir.stack_dump(attempt, rank)
        if not dump.is_file():
            continue
        target = launch.stack_copy(attempt, rank)
        try:
            shutil.copyfile(dump, target)
        except OSError as err:
            log.warning("could not collect %s: %s", dump, err)
            continue
        copied.append(target)
    return copied


def _stacks(dumps: list[Path]) -> dict[int, str]:
    out = {}
    for dump in dumps:
        rank, text = _dump_rank(dump.name), _read_text(dump)
        if rank is not None and text is not None:
            out[rank] = text
    return out


def _dump_rank(name: str) -> int | None:
    digits = name.removeprefix("stacks_rank").removesuffix(".txt")
    return int(digits) if digits.isdigit() else None


_STACK_CAP = 256 * 1024  # bytes of a stack dump read (a dump of thousands of threads is cut)


def _read_text(path: Path) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read(_STACK_CAP)
    except OSError:
        return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _signal_number(name: str | None) -> int | None:
    if name is None:
        return None
    try:
        return int(signal.Signals[name])
    except KeyError:
        digits = "".join(ch for ch in name if ch.isdigit())
        return int(digits) if digits else None


# ------------------------------------------------------------------------------------------------ the summary
def summary(record: AttemptRecord, launch: LaunchDir) -> str:
    """The one line the launcher says on stderr after an attempt."""
    took = record.ended_at - record.started_at
    head = f"attempt {record.attempt} {record.outcome} after {took:.1f} s"
    if record.cause is not None:
        c = record.cause
        how = {
            "signal": f"killed by {c.detail}",
            "verdict": f"ended: {c.detail} (exit {c.exit_code})",
            "exit": f"exited with status {c.detail}",
            "lost": c.detail,
        }.get(c.kind, f"{c.detail}" + (f": {c.message.splitlines()[0][:160]}" if c.message else ""))
        victims = [f"rank {r.rank}" for r in record.ranks if r.role == "victim"]
        who = f"rank {c.rank}" if c.rank is not None else "no single rank"
        head += f"; cause: {who} {how}" + (f" (then {', '.join(victims)})" if victims else "")
    elif record.agent_error:
        head += f"; torchrun: {record.agent_error[:200]}"
    steps = f"newest committed step {_step(record.step_at_end)} (was {_step(record.step_at_start)})"
    if record.hang_dumps:
        steps += f"; stack dumps: {', '.join(record.hang_dumps)}"
    tail = f"{record.decision}: {record.reason}"
    if record.exit_code is not None:
        tail += f"; exit {record.exit_code}"
    return f"{head}; {steps}; {tail} [{launch.attempts}]"


def _step(step: int | None) -> str:
    return "none" if step is None else str(step)
