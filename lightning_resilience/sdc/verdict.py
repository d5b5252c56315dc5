"""Diagnoses of SDC verification, the events that carry them, and the error raised when training must not go on.

A :class:`Diagnosis` classifies one check of one step; a diagnosis that leaves the state corrupt becomes a
:class:`~lightning_resilience.policy.Verdict` (event ``sdc_mismatch``) posted to the suite's policy."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from lightning_resilience.exit_codes import ExitCode

__all__ = ["Diagnosis", "SDCEvent", "SilentDataCorruptionError", "StepOutcome", "VerifiedSteps"]


class VerifiedSteps:
    """The steps a clean check covered, in order. What a step asks of them (is this step verified, the newest, the
    newest few for a checkpoint) costs the same at the run's first step and its millionth."""

    def __init__(self, steps: Iterable[int] = (0,)) -> None:
        self._members = {int(s) for s in steps}
        self._order = sorted(self._members)

    def add(self, step: int) -> None:
        if step in self._members:
            return
        self._members.add(step)
        if not self._order or step > self._order[-1]:
            self._order.append(step)  # the common case: checks come in step order
        else:
            bisect.insort(self._order, step)

    def keep_until(self, step: int) -> None:
        """Forget the steps after ``step`` (a rollback to it), and take ``step`` itself as verified."""
        while self._order and self._order[-1] > step:
            self._members.discard(self._order.pop())
        self.add(step)

    @property
    def newest(self) -> int:
        return self._order[-1]

    def newest_few(self, count: int) -> list[int]:
        return self._order[-count:]

    def __contains__(self, step: object) -> bool:
        return step in self._members

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class Diagnosis(str, Enum):
    """What a check concluded about one step."""

    CLEAN = "clean"
    """Every opinion agreed."""
    ANOMALY = "anomaly"
    """A guard fired but the replay reproduced the step bit for bit: the data or the model did it, not the device."""
    TRANSIENT = "transient"
    """A rank computed a wrong result once; its own replay and the others agree on another one."""
    PERSISTENT = "persistent"
    """A rank reproduces a result that other ranks do not: a faulty device."""
    DIVERGED = "diverged"
    """Replicas hold different parameters or optimizer state after the optimizer step."""
    INCONCLUSIVE = "inconclusive"
    """Opinions disagree and the evidence names no rank: no strict majority of at least three equivalent replicas,
    and no deterministic self-replay that reproduces the reference (e.g. two replicas). The state is still rejected
    (stop or roll back), but no rank is blamed."""
    UNRESOLVED = "inconclusive"
    """Former name of :attr:`INCONCLUSIVE`."""


@dataclass
class SDCEvent:
    """One detection: where, by what, which ranks are suspect, and what was done about it."""

    step: int
    mechanism: str
    """'guard:<name>', 'replay' or 'reconcile'."""
    verdict: Diagnosis
    suspects: list[int] = field(default_factory=list)
    action: str = "none"
    """'none', 'recomputed' (fixed in place before the optimizer step), 'rollback' or 'stop'."""
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["verdict"] = self.verdict.value
        return out


class SilentDataCorruptionError(RuntimeError):
    """Training state is corrupt and cannot be fixed in place.

    Restart from ``rollback_step`` (the newest checkpoint verified clean) after excluding the ``suspects``;
    ``exit_code`` is what a launcher should see.
    """

    exit_code = ExitCode.SDC

    def __init__(self, message: str, *, verdict: Diagnosis, step: int, suspects: list[int], rollback_step: int | None):
        super().__init__(message)
        self.verdict = verdict
        self.step = step
        self.suspects = suspects
        self.rollback_step = rollback_step


@dataclass
class StepOutcome:
    """What the checks of one step concluded."""

    step: int
    events: list[SDCEvent] = field(default_factory=list)
    checked: bool = False
    """At least one check (replay or reconciliation) ran."""
    needs_rollback: bool = False
    suspects: list[int] = field(default_factory=list)
    bad_step: int | None = None
    """For a late non-finite guard: the earliest step whose update was non-finite (agreed by every rank)."""
