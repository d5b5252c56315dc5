"""What the checkpoint engine did and what it cost: counters for metrics and the end-of-run report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CheckpointStats", "PersistResult", "Restored", "TierStats"]


@dataclass
class TierStats:
    """Counters of one tier, for metrics and the end-of-run report."""

    writes: int = 0
    failures: int = 0
    deferred: int = 0
    bytes: int = 0
    seconds: float = 0.0
    last_step: int | None = None
    last_error: str | None = None

    def record_write(self, step: int, nbytes: int, seconds: float) -> None:
        self.writes += 1
        self.bytes += nbytes
        self.seconds += seconds
        self.last_step = step

    @property
    def mean_write_seconds(self) -> float | None:
        return self.seconds / self.writes if self.writes else None

    def record_failure(self, err: BaseException) -> str:
        self.failures += 1
        self.last_error = f"{type(err).__name__}: {err}"
        return self.last_error


@dataclass
class CheckpointStats:
    """What the engine did and what it cost."""

    captures: int = 0
    capture_seconds: float = 0.0
    capture_seconds_max: float = 0.0
    last_capture_seconds: float = 0.0
    wait_seconds: float = 0.0
    """Part of ``capture_seconds`` spent waiting for a background copy before an optimizer step."""
    state_bytes: int = 0
    host_bytes: int = 0
    tiers: dict[str, TierStats] = field(default_factory=dict)
    restored_step: int | None = None
    restored_from: str | None = None
    restore_seconds: float = 0.0
    restored_at: float | None = None
    """Wall-clock time (time.time) when the resume's restore ended."""
    skipped_corrupt: list[str] = field(default_factory=list)
    rejected_steps: list[int] = field(default_factory=list)
    """Steps a verdict rejected in this rank's tiers (:meth:`CheckpointManager.reject`)."""

    @property
    def capture_seconds_mean(self) -> float:
        return self.capture_seconds / self.captures if self.captures else 0.0


@dataclass
class Restored:
    """The outcome of a collective restore."""

    step: int
    state: Any
    tier: str
    seconds: float
    meta: dict[str, Any]


@dataclass
class PersistResult:
    """One tier write of a background persist: what was written, how long it took, or why it failed; the steps
    retention deleted after it."""

    tier: str
    step: int
    nbytes: int
    seconds: float
    error: BaseException | None = None
    deleted: Sequence[int] = ()
