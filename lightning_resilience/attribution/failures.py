"""The records of attribution: how each rank's process ended (:class:`RankExit`), what an attempt left behind
(:class:`AttemptEvidence`), how a rank failed (:class:`RankFailure`) and why an attempt ended (:class:`Attribution`).
"""

from __future__ import annotations

import enum
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_resilience.ft.restart import FaultNote

__all__ = ["AttemptEvidence", "Attribution", "FailureKind", "RankExit", "RankFailure", "Role", "peer_symptom"]


class FailureKind(str, enum.Enum):
    """How a rank failed."""

    SIGNAL = "signal"
    EXIT_CODE = "exit_code"
    EXCEPTION = "exception"
    HANG = "hang"
    PREEMPTION = "preemption"
    SDC = "sdc"
    STRAGGLER = "straggler"
    NO_PROGRESS = "no_progress"
    LOST = "lost"
    """Ended without a trace: no fault note and no exit record."""


class Role(str, enum.Enum):
    CULPRIT = "culprit"
    VICTIM = "victim"


# Errors a rank sees when a *peer* failed: the collective's connection dropped, timed out or was aborted, or the
# launcher's teardown signal arrived. Matched case-insensitively, the symptoms before the places they come from.
_PEER_SYMPTOMS = tuple(
    re.compile(p, re.IGNORECASE)
    for p in (
        r"connection (reset|closed|refused|aborted)( by peer)?|reset by peer|closed by peer|broken pipe",
        r"econnreset|epipe|socket timeout|timed out waiting|timeout waiting|collective operation timeout",
        r"watchdog caught collective|nccl communicator was aborted|ncclremoteerror|remote process exited",
        r"got signal \d+|signalexception",
        r"distnetworkerror|distbackenderror|gloo/transport|transport/tcp",
    )
)


def peer_symptom(text: str) -> str | None:
    """The words of ``text`` that say a peer failed (a dropped connection, a timed-out collective), if any."""
    for pattern in _PEER_SYMPTOMS:
        match = pattern.search(text)
        if match is not None:
            return match.group(0)
    return None


_TEARDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass(frozen=True)
class RankExit:
    """How one rank's process ended, as its launcher saw it."""

    rank: int
    exit_code: int | None = None
    """The status of a normal exit; None when it was killed by a signal or is unknown."""
    signal: int | None = None
    """The signal that killed it (9 for SIGKILL), if one did."""
    exited_at: float | None = None
    """Wall-clock seconds (time.time) when the launcher saw it end."""
    exception: str | None = None
    """``"Type: message"`` of the exception it raised, when its launcher recorded one."""
    stopped_by_launcher: bool = False
    """The launcher stopped it after another rank failed (its own end was not observed)."""

    @classmethod
    def from_returncode(cls, rank: int, returncode: int, exited_at: float | None = None) -> RankExit:
        """From a ``subprocess`` return code (negative: killed by that signal)."""
        if returncode < 0:
            return cls(rank, None, -returncode, exited_at)
        return cls(rank, returncode, None, exited_at)

    @property
    def failed(self) -> bool:
        return (
            self.signal is not None or self.stopped_by_launcher or (self.exit_code is not None and self.exit_code != 0)
        )


@dataclass
class AttemptEvidence:
    """What one attempt left behind (any part may be missing)."""

    attempt: int
    """Index of the attempt in the job (0 for the first process start)."""
    world_size: int | None = None
    end_reason: str | None = None
    """The ledger's account: 'finished', 'preempted', 'exception', 'hang', 'lost', or None (still running)."""
    started_at: float | None = None
    ended_at: float | None = None
    last_step: int | None = None
    exits: dict[int, RankExit] = field(default_factory=dict)
    """From the launcher's record of the attempt (empty without one)."""
    first_failing_rank: int | None = None
    """The rank the launcher saw fail first, when it says."""
    notes: list[FaultNote] = field(default_factory=list)
    stacks: dict[int, str] = field(default_factory=dict)
    """Stack dump text per rank (hangs)."""

    @property
    def ended_cleanly(self) -> bool:
        return self.end_reason in ("finished", None) and not any(e.failed for e in self.exits.values())


@dataclass(frozen=True)
class RankFailure:
    """How one rank failed, and its part in the attempt's end."""

    rank: int | None
    """None when no single rank can be named."""
    kind: FailureKind
    detail: str
    role: Role = Role.CULPRIT
    at: float | None = None
    """Wall-clock seconds when it failed (a hang: when it got stuck), when known."""
    step: int | None = None
    evidence: tuple[str, ...] = ()
    """What says so: 'launcher record', 'fault note', 'stack dump', 'ledger', 'inferred'."""
    stacks: str | None = None
    """Path of the stack dump."""
    where: str | None = None
    """Where the training thread stood (hangs)."""

    @property
    def inferred(self) -> bool:
        return "inferred" in self.evidence

    @property
    def peer_error(self) -> bool:
        """The failure looks like the consequence of another rank's (a broken collective, a teardown signal)."""
        if "stopped by the launcher" in self.evidence:
            return True
        if self.kind is FailureKind.EXCEPTION:
            return peer_symptom(self.detail) is not None
        if self.kind is FailureKind.SIGNAL:
            return any(s.name in self.detail for s in _TEARDOWN_SIGNALS)
        return False

    def brief(self, width: int = 80) -> str:
        """A one-line gist: for an error a peer's failure caused, its type and the symptom ('RuntimeError: ...
        reset by peer'); otherwise the first line of the detail, cut to ``width``."""
        first = self.detail.splitlines()[0] if self.detail else self.kind.value
        if self.where:
            first += f", {self.where}"
        if self.kind is FailureKind.EXCEPTION and self.peer_error:
            kind = first.split(":", 1)[0] if ":" in first and " " not in first.split(":", 1)[0] else "error"
            first = f"{kind}: {peer_symptom(self.detail)} (a peer failed)"
        return first if len(first) <= width else first[: width - 1] + "…"

    def describe(self) -> str:
        who = "no single rank" if self.rank is None else f"rank {self.rank}"
        step = f" at step {self.step}" if self.step is not None else ""
        return f"{who}: {self.detail}{step}"

    def to_json(self) -> dict[str, Any]:
        return {
            "brief": self.brief(),
            "rank": self.rank,
            "kind": self.kind.value,
            "detail": self.detail,
            "role": self.role.value,
            "at": self.at,
            "step": self.step,
            "evidence": list(self.evidence),
            "stacks": self.stacks,
            "where": self.where,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankFailure:
        return cls(
            rank=data.get("rank"),
            kind=FailureKind(data.get("kind", "lost")),
            detail=str(data.get("detail", "")),
            role=Role(data.get("role", "culprit")),
            at=data.get("at"),
            step=data.get("step"),
            evidence=tuple(data.get("evidence") or ()),
            stacks=data.get("stacks"),
            where=data.get("where"),
        )


@dataclass(frozen=True)
class Attribution:
    """Why an attempt ended: its culprit and the victims."""

    attempt: int
    outcome: str
    """'finished', 'running', 'fault', 'preempted' or 'stopped' (a decision of the job: SDC, straggler, policy)."""
    cause: RankFailure | None
    victims: tuple[RankFailure, ...] = ()
    detection_s: float | None = None
    """From the fault to its detection: a hang's stuck time, else to the end of the attempt when both are known."""

    def headline(self) -> str:
        if self.cause is None:
            return {"finished": "finished", "running": "running (no end recorded yet)"}.get(self.outcome, self.outcome)
        text = self.cause.describe()
        if self.cause.inferred:
            text += " (inferred)"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "outcome": self.outcome,
            "headline": self.headline(),
            "cause": self.cause.to_json() if self.cause else None,
            "victims": [v.to_json() for v in self.victims],
            "detection_s": self.detection_s,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Attribution:
        cause = data.get("cause")
        return cls(
            attempt=int(data.get("attempt", 0)),
            outcome=str(data.get("outcome", "fault")),
            cause=RankFailure.from_json(cause) if isinstance(cause, Mapping) else None,
            victims=tuple(RankFailure.from_json(v) for v in data.get("victims") or [] if isinstance(v, Mapping)),
            detection_s=data.get("detection_s"),
        )
