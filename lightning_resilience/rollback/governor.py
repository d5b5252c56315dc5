"""The engine of in-process rollback: which snapshot to restore, when to stop rolling back and escalate, and the
learning-rate cool-down after a rollback. Framework-free (torch only); the Lightning adapter restores the state.

Steps are counted as optimizer steps done: the state ``s`` is the one the batch of step ``s`` starts from. A bad step
``b`` (its batch produced a non-finite loss or gradient, a spike, or a corrupt update) makes state ``b + 1`` and every
later one suspect; the newest snapshot at or before ``b - steps_back`` is restored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lightning_resilience.rollback.config import RollbackConfig

__all__ = ["LrCooldown", "RollbackGovernor", "RollbackPlan", "RollbackRecord"]


@dataclass(frozen=True)
class RollbackPlan:
    """What to do about one verdict: restore ``target`` (None: no snapshot old enough), or escalate."""

    bad_step: int
    detected_at: int
    target: int | None
    escalate: bool
    reason: str
    """Why it escalates ('' when it does not)."""
    recurs: bool = False
    """Escalating at the cap, every rollback of the window was for this very bad step and left its batch out: the
    fault comes back at this step whatever the batch, so the data is not its cause (a device fault at a
    deterministic point of the step is): a restart elsewhere can help where one from the same data cannot."""


@dataclass
class RollbackRecord:
    """One rollback as the report and the quarantine file list it."""

    cause: str
    """The event ('nonfinite', 'spike', 'sdc_mismatch')."""
    bad_step: int
    detected_at: int
    """The step at whose end the ranks decided (the verdict is read late: ``detected_at > bad_step``)."""
    target: int
    steps_lost: int
    """Optimizer steps undone: ``detected_at - target``."""
    seconds: float = 0.0
    """From the decision to the restored state (host wall time on this rank)."""
    skipped: dict[str, list[int]] = field(default_factory=dict)
    """Global rank -> sample indices of the skipped batch on that rank (empty: not skipped)."""
    detail: str = ""
    escalated: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class RollbackGovernor:
    """Plans rollbacks, enforces the cap per window, and keeps the record of what was done.

    Args:
        config: how far back, the cap, the cool-down.
    """

    def __init__(self, config: RollbackConfig | None = None) -> None:
        self.config = config or RollbackConfig()
        self.records: list[RollbackRecord] = []

    def in_window(self, bad_step: int) -> int:
        """Rollbacks done whose bad step lies within ``window_steps`` before ``bad_step``."""
        lo = bad_step - self.config.window_steps
        return sum(1 for r in self.records if not r.escalated and lo < r.bad_step)

    def plan(self, bad_step: int, detected_at: int, common_steps: Iterable[int]) -> RollbackPlan:
        """Choose the snapshot to restore among the steps every rank holds in RAM (``common_steps``).

        Escalates when the cap of the window is reached (the state is still restored first, so that what is persisted
        is good) or when no snapshot is old enough (then nothing can be restored in the process).
        """
        if bad_step > detected_at:
            raise ValueError(f"bad step {bad_step} is after the step it was detected at ({detected_at})")
        limit = bad_step - self.config.steps_back
        candidates = [s for s in common_steps if s <= limit]
        target = max(candidates) if candidates else None
        if target is None:
            return RollbackPlan(bad_step, detected_at, None, True, f"no RAM snapshot at or before step {limit}")
        done = self.in_window(bad_step)
        if done >= self.config.max_rollbacks:
            reason = (
                f"{done} rollback(s) within {self.config.window_steps} steps (policy.rollback.max_rollbacks="
                f"{self.config.max_rollbacks})"
            )
            return RollbackPlan(bad_step, detected_at, target, True, reason, recurs=self._recurs(bad_step))
        return RollbackPlan(bad_step, detected_at, target, False, "")

    def _recurs(self, bad_step: int) -> bool:
        lo = bad_step - self.config.window_steps
        window = [r for r in self.records if not r.escalated and lo < r.bad_step]
        return bool(window) and all(r.bad_step == bad_step and r.skipped for r in window)

    def record(self, record: RollbackRecord) -> None:
        self.records.append(record)

    def report(self) -> dict[str, Any]:
        return {
            "rollbacks": [r.to_json() for r in self.records if not r.escalated],
            "escalated": next((r.to_json() for r in self.records if r.escalated), None),
            "steps_lost": sum(r.steps_lost for r in self.records),
            "seconds": sum(r.seconds for r in self.records),
        }


class LrCooldown:
    """Scales every learning rate by ``factor`` for the next ``steps`` optimizer steps after a rollback.

    The rate is scaled inside ``optimizer.step()`` (pre hook) and put back right after it (post hook), so a
    scheduler, which runs after the step, never sees the scaled value and its own schedule is unchanged.
    """

    def __init__(self, factor: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.factor = factor
        self.remaining = 0
        self._saved: dict[int, list[float]] = {}
        self._handles: list[Any] = []
        self._clock = clock

    def install(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.remove()
        for opt in optimizers:
            self._handles.append(opt.register_step_pre_hook(self._before))
            self._handles.append(opt.register_step_post_hook(self._after))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def start(self, steps: int) -> None:
        self.remaining = steps

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.remaining <= 0:
            return
        self._saved[id(optimizer)] = [float(g["lr"]) for g in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = float(group["lr"]) * self.factor

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        saved = self._saved.pop(id(optimizer), None)
        if saved is None:
            return
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr
        if not self._saved:  # every optimizer of this step has stepped
            self.remaining -= 1
