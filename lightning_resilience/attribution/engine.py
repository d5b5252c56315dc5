"""Who ended an attempt, and how: the culprit rank and the victims, from what each rank left behind.

When one rank of a data-parallel job fails, the others fail after it: their next collective breaks ("connection
reset by peer"), their watchdog sees them stuck waiting, the launcher tears them down with SIGTERM. Reporting the
first error that reached rank 0 names a victim. As NVRx's attribution (a primary failure and its cascades) and
ByteRobust's (the outlier among the ranks' stacks) do, this module separates the one **culprit** (the rank that
failed first, and how: a signal, an exit code, an exception, a hang with its stack, a preemption notice, an SDC or
straggler stop) from the **victims** (the ranks that failed because of it).

The evidence of one attempt (:class:`AttemptEvidence`) is what survives it: the launcher's record of each rank's
exit (code or signal, and when), the fault notes ranks wrote before they went, the stack dumps of hung ranks, and
the ledger's view of how the attempt ended. A rank that left nothing while its peers saw the connection drop died
without notice (SIGKILL, the OOM killer, a lost node): that is itself the diagnosis, marked as inferred.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_resilience.attribution.failures import (
    AttemptEvidence,
    Attribution,
    FailureKind,
    RankExit,
    RankFailure,
    Role,
)
from lightning_resilience.attribution.stacks import StackSummary, summarize_stacks
from lightning_resilience.exit_codes import ExitCode
from lightning_resilience.ft.restart import FaultNote

__all__ = [
    "AttemptEvidence",
    "Attribution",
    "FailureKind",
    "RankExit",
    "RankFailure",
    "Role",
    "attribute",
    "attribute_all",
]

# decisions the whole job takes together: every rank exits with the same code, none of them a victim
_JOB_STOPS = {
    FailureKind.PREEMPTION: ExitCode.PREEMPTED,
    FailureKind.SDC: ExitCode.SDC,
    FailureKind.STRAGGLER: ExitCode.STRAGGLER,
    FailureKind.NO_PROGRESS: ExitCode.NO_PROGRESS,
}
_EXIT_KINDS = {int(code): kind for kind, code in _JOB_STOPS.items()} | {int(ExitCode.HANG): FailureKind.HANG}
_NOTE_KINDS = {kind.value: kind for kind in FailureKind}


# ---------------------------------------------------------------------------------------------- per rank
def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _exit_detail(code: int) -> str:
    try:
        return f"exited with code {code} ({ExitCode(code).name})"
    except ValueError:
        return f"exited with code {code}" + (" (an uncaught error)" if code == 1 else "")


def _from_exit(record: RankExit, step: int | None) -> RankFailure:
    ev: tuple[str, ...] = ("launcher record",)
    if record.stopped_by_launcher:
        how = f" ({_signal_name(record.signal)})" if record.signal is not None else ""
        detail = f"stopped by the launcher{how} after another rank failed"
        kind = FailureKind.SIGNAL if record.signal is not None else FailureKind.EXIT_CODE
        return RankFailure(
            record.rank, kind, detail, at=record.exited_at, step=step, evidence=(*ev, "stopped by the launcher")
        )
    if record.exception:
        detail = record.exception + (f" [exit {record.exit_code}]" if record.exit_code not in (None, 1) else "")
        return RankFailure(record.rank, FailureKind.EXCEPTION, detail, at=record.exited_at, step=step, evidence=ev)
    if record.signal is not None:
        detail = f"killed by {_signal_name(record.signal)} (signal {record.signal})"
        return RankFailure(record.rank, FailureKind.SIGNAL, detail, at=record.exited_at, step=step, evidence=ev)
    code = int(record.exit_code or 0)
    if code > 128 and code - 128 < 65:  # a shell reports a signal as 128 + n
        detail = f"killed by {_signal_name(code - 128)} (exit code {code})"
        return RankFailure(record.rank, FailureKind.SIGNAL, detail, at=record.exited_at, step=step, evidence=ev)
    kind = _EXIT_KINDS.get(code, FailureKind.EXIT_CODE)
    return RankFailure(record.rank, kind, _exit_detail(code), at=record.exited_at, step=step, evidence=ev)


def _from_note(note: FaultNote, record: RankExit | None, stacks: StackSummary | None) -> RankFailure:
    kind = _NOTE_KINDS.get(note.kind, FailureKind.EXCEPTION)
    evidence = ["fault note"]
    at: float | None = note.detected_at
    detail = note.message or note.kind
    where = None
    if kind is FailureKind.HANG:
        if note.detection_s is not None and math.isfinite(note.detection_s):
            at = note.detected_at - note.detection_s  # when it got stuck
        detail = "hung" + (f" in section {note.section!r}" if note.section else "")
        if note.detection_s is not None:
            detail += f" for {note.detection_s:.1f} s"
        if note.timeout_s is not None:
            detail += f" (timeout {note.timeout_s:.1f} s)"
        if stacks is not None and stacks.innermost is not None:
            evidence.append("stack dump")
            where = stacks.describe()
    if record is not None:
        evidence.append("launcher record")
        if record.failed:
            end = (
                f"killed by {_signal_name(record.signal)}" if record.signal is not None else f"exit {record.exit_code}"
            )
            detail += f" [{end}]"
    return RankFailure(
        note.rank, kind, detail, at=at, step=note.step, evidence=tuple(evidence), stacks=note.stacks, where=where
    )


def _rank_failures(ev: AttemptEvidence) -> tuple[list[RankFailure], dict[int, StackSummary]]:
    summaries = {rank: summarize_stacks(text) for rank, text in ev.stacks.items()}
    by_rank: dict[int, list[FaultNote]] = {}
    for note in sorted(ev.notes, key=lambda n: n.detected_at):
        by_rank.setdefault(note.rank, []).append(note)
    ranks = set(by_rank) | set(ev.exits) | set(range(ev.world_size or 0))
    failures: list[RankFailure] = []
    silent: list[int] = []
    for rank in sorted(ranks):
        notes, record = by_rank.get(rank, []), ev.exits.get(rank)
        if notes:
            # a rank's first note is its own failure; a later one on the same rank is its aftermath
            failures.append(_from_note(notes[0], record, summaries.get(rank)))
        elif record is not None and record.failed:
            failures.append(_from_exit(record, ev.last_step))
        elif record is None:
            silent.append(rank)
    faulted = ev.end_reason not in ("finished", "preempted", None) or any(f.kind not in _JOB_STOPS for f in failures)
    if silent and faulted and not ev.exits:
        # no launcher record: a rank that left nothing while the attempt failed died without notice
        detail = "died without a trace (no fault note, no exit record): a SIGKILL, the OOM killer or a lost node"
        failures += [
            RankFailure(rank, FailureKind.LOST, detail, step=ev.last_step, evidence=("inferred",)) for rank in silent
        ]
    return failures, summaries


# ---------------------------------------------------------------------------------------------- the culprit
def _secondary(failure: RankFailure, summaries: Mapping[int, StackSummary]) -> bool:
    """Looks like a consequence of another rank's failure."""
    if failure.kind is FailureKind.HANG and failure.rank is not None:
        summary = summaries.get(failure.rank)
        return summary is not None and summary.waits_on_peers
    return failure.peer_error


def _first(pool: list[RankFailure], summaries: Mapping[int, StackSummary]) -> RankFailure:
    """Who failed first: recorded evidence before an inference; among hangs, the rank that got least far (an
    earlier step, an earlier phase of the step: the others wait for it in a collective); otherwise the earliest
    time (a failure with a time before one without); then the lowest rank."""
    known = [f for f in pool if not f.inferred] or pool
    if all(f.kind is FailureKind.HANG for f in known):

        def progress(f: RankFailure) -> tuple[float, ...]:
            summary = summaries.get(f.rank) if f.rank is not None else None
            phase = summary.phase_index if summary is not None and summary.phase_index is not None else 99
            return (float(f.step or 0), float(phase), f.at if f.at is not None else math.inf, float(f.rank or 0))

        return min(known, key=progress)
    return min(
        known, key=lambda f: (f.at is None, f.at if f.at is not None else 0.0, f.rank if f.rank is not None else 0)
    )


def attribute(ev: AttemptEvidence) -> Attribution:
    """The culprit and the victims of one attempt.

    The culprit is the first failure that does not look like a consequence of another (a broken collective, a
    teardown signal, a hang waiting in a collective), in the order the launcher saw the ranks fail when it says,
    else by time; when every failure looks like a consequence, the first of them. A job-level stop (preemption,
    SDC, straggler, policy) ends every rank with the same code: those ranks are not victims.
    """
    failures, summaries = _rank_failures(ev)
    if len(failures) > 1 and all(f.kind is FailureKind.LOST for f in failures):
        failures = []  # every rank silent: nothing singles one out
    if not failures:
        if ev.end_reason in ("lost", "exception", "hang"):
            cause = RankFailure(
                None,
                FailureKind.LOST,
                f"the attempt ended ({ev.end_reason}) and no rank left a note or an exit record",
                step=ev.last_step,
                evidence=("ledger", "inferred"),
            )
            return Attribution(ev.attempt, "fault", cause)
        return Attribution(ev.attempt, "running" if ev.end_reason is None and not ev.exits else "finished", None)
    primaries = [f for f in failures if not _secondary(f, summaries)]
    # a rank the launcher stopped after another failed is never the culprit, even when nothing else is known
    pool = primaries or [f for f in failures if "stopped by the launcher" not in f.evidence]
    if not pool:
        return Attribution(ev.attempt, "fault", None)
    named = [f for f in pool if f.rank is not None and f.rank == ev.first_failing_rank]
    common = None if named else _common_failure(primaries)
    if common is not None:
        consequences = tuple(_as_victim(f) for f in failures if f not in primaries)
        return Attribution(ev.attempt, "fault", common, consequences, _detection(ev, common))
    cause = named[0] if named else _first(pool, summaries)
    if named:
        cause = _with_evidence(cause, "launcher: failed first")
    job_code = _JOB_STOPS.get(cause.kind)
    alike = [f for f in failures if f.kind is cause.kind]
    if job_code is not None and "fault note" not in cause.evidence and len(alike) > 1:
        # the same decided code on every rank and no note saying who triggered it: the job decided, not a rank
        ranks = ", ".join(str(f.rank) for f in alike)
        cause = RankFailure(**{**_fields(cause), "rank": None, "detail": f"ranks {ranks}: {cause.detail}"})
    victims = []
    for f in failures:
        if f is cause:
            continue
        record = ev.exits.get(f.rank) if f.rank is not None else None
        if job_code is not None and (f.kind is cause.kind or (record is not None and record.exit_code == job_code)):
            continue  # stopped together with the job, by agreement
        victims.append(_as_victim(f))
    outcome = "fault"
    if cause.kind is FailureKind.PREEMPTION:
        outcome = "preempted"
    elif job_code is not None:
        outcome = "stopped"
    return Attribution(ev.attempt, outcome, cause, tuple(victims), _detection(ev, cause, victims))


def _common_failure(primaries: list[RankFailure]) -> RankFailure | None:
    """Several ranks failing the same way on their own (one exception message, one exit code, one signal) is no
    rank's fault: the code, the data or the job as a whole. None when the failures differ."""
    if len(primaries) < 2 or any(
        f.kind is FailureKind.HANG or f.kind in _JOB_STOPS or f.rank is None for f in primaries
    ):
        return None
    first = primaries[0]
    if any(f.kind is not first.kind or f.brief() != first.brief() for f in primaries):
        return None
    times = [f.at for f in primaries if f.at is not None]
    if first.kind is FailureKind.SIGNAL and times and max(times) - min(times) > 1.0:
        return None  # one rank killed, the others stopped after it (the launcher's SIGKILL after its SIGTERM)
    ranks = ", ".join(str(f.rank) for f in sorted(primaries, key=lambda f: f.rank or 0))
    return RankFailure(
        None,
        first.kind,
        f"the same failure on ranks {ranks}: {first.detail}",
        at=min((f.at for f in primaries if f.at is not None), default=None),
        step=first.step,
        evidence=(*first.evidence, "same on every failing rank"),
    )


def _with_evidence(failure: RankFailure, item: str) -> RankFailure:
    return RankFailure(**{**_fields(failure), "evidence": (*failure.evidence, item)})


def _as_victim(failure: RankFailure) -> RankFailure:
    return RankFailure(**{**_fields(failure), "role": Role.VICTIM})


def _fields(failure: RankFailure) -> dict[str, Any]:
    return {name: getattr(failure, name) for name in RankFailure.__dataclass_fields__}


def _detection(ev: AttemptEvidence, cause: RankFailure, victims: Sequence[RankFailure] = ()) -> float | None:
    """A hang's stuck time; else from the culprit's failure to the first sign of it elsewhere (a victim's error),
    or to the end of the attempt."""
    if cause.kind is FailureKind.HANG:
        note = next((n for n in ev.notes if n.rank == cause.rank and n.kind == "hang"), None)
        if note is not None and note.detection_s is not None:
            return float(note.detection_s)
    if cause.at is None:
        return None
    later = [v.at for v in victims if v.at is not None and v.at >= cause.at]
    if later:
        return min(later) - cause.at
    if ev.ended_at is not None and ev.ended_at >= cause.at:
        return ev.ended_at - cause.at
    return None


def attribute_all(evidence: Sequence[AttemptEvidence]) -> list[Attribution]:
    return [attribute(ev) for ev in evidence]
