"""What the suite's members offer each other through the suite: small protocols, so that no callback imports or
reads another."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from lightning.pytorch import Trainer

from lightning_resilience.checkpoint.stats import CheckpointStats, Restored

__all__ = ["CheckpointStore", "Reporting"]


class Reporting(Protocol):
    """A member that contributes a section to the end-of-run report."""

    report_section: str

    def report(self) -> dict[str, Any]: ...

    def summary(self) -> str: ...


class CheckpointStore(Protocol):
    """What the suite (and through it, the other members) may ask of the checkpoint member."""

    @property
    def stats(self) -> CheckpointStats: ...

    def committed_steps(self) -> dict[str, list[int]]:
        """Committed steps per tier on this rank, once a persist in flight has finished."""
        ...

    def memory_steps(self) -> list[int]:
        """Steps held in RAM on this rank."""
        ...

    def persisted_steps(self) -> dict[str, int | None]:
        """The newest committed step of each tier that outlives the process."""
        ...

    def cadence_changes(self) -> list[tuple[int, str, int, str]]:
        """(step, tier, every_n_steps, why) of every cadence the cost budget chose so far."""
        ...

    def add_meta_provider(self, provider: Callable[[int], dict[str, Any]]) -> None: ...

    def reject_after(self, step: int, reason: str) -> list[int]:
        """Reject every step newer than ``step`` in every tier (a verdict found the state corrupt after it); every
        rank calls it at the same decision. Returns the steps rejected on this rank."""
        ...

    def persist_now(self, trainer: Trainer, meta: dict[str, Any] | None = None) -> None:
        """Collective: persist the current step to every persistent tier and wait."""
        ...

    def emergency_save(self, collective: bool = True) -> int | None: ...

    def restore_memory(self, step: int) -> Restored:
        """Collective: load ``step`` from RAM on every rank (an in-process rollback)."""
        ...

    def rollback_to(self, trainer: Trainer, restored: Restored, skip_ahead: int | None) -> list[Any]:
        """Apply a restored RAM snapshot in the running process (every part of the Trainer's state)."""
        ...

    def report_section(self, blocking_timeline: list[tuple[int, float]]) -> dict[str, Any]:
        """Its section of the end-of-run report."""
        ...

    def summary(self) -> str: ...
