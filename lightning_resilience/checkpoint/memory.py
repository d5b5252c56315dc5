"""MemoryTier: the newest snapshots kept in host RAM, for restores within the process (rollback, retry)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_resilience._configurable import config_from_args
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.snapshot import HostSnapshot, StagedSnapshot
from lightning_resilience.checkpoint.tier import Durability, TierIdentity, Written, check_cadence
from lightning_resilience.collective import Deadline

__all__ = ["MemoryTier"]


class MemoryTier:
    """Keeps the last ``keep`` snapshots in host memory (a :class:`~lightning_resilience.checkpoint.tier.RamTier`).

    The manager hands it the snapshot buffers themselves (:meth:`adopt`), so a per-step RAM checkpoint costs no
    second copy; :meth:`read` returns a clone because the buffers are reused once they fall out of the window.

    Takes a :class:`MemoryTier.Config`, or its fields as arguments: ``MemoryTier(every_n_steps=1, keep=2)``.
    """

    @dataclass(kw_only=True)
    class Config:
        """Host-RAM tier."""

        every_n_steps: int = 1
        """Snapshot cadence in optimizer steps."""
        keep: int = 2
        """Snapshots held in RAM (each costs one training state of host memory)."""
        name: str = "memory"
        """Label in logs, metrics and the report."""

        def __post_init__(self) -> None:
            check_cadence(f"tiers.{self.name}", self.every_n_steps, self.keep)

        def build(self) -> MemoryTier:
            return MemoryTier(self)

    durability = Durability.process
    collective = False

    def __init__(self, *args: Any, **settings: Any) -> None:
        self.config = config_from_args(MemoryTier.Config, args, settings, "MemoryTier")
        self.name = self.config.name
        self.every_n_steps = self.config.every_n_steps
        self.keep = self.config.keep
        self._held: OrderedDict[int, tuple[HostSnapshot, Callable[[HostSnapshot], None]]] = OrderedDict()
        self._copies: OrderedDict[int, StagedSnapshot] = OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MemoryTier(every_n_steps={self.every_n_steps}, keep={self.keep})"

    def __getstate__(self) -> dict[str, Any]:
        # held snapshots belong to this process (and a lock cannot be pickled): a spawned copy starts empty
        state = self.__dict__.copy()
        del state["_lock"]
        state["_held"], state["_copies"] = OrderedDict(), OrderedDict()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def bind(self, identity: TierIdentity) -> None:
        self._identity = identity

    def adopt(self, slot: HostSnapshot, release: Callable[[HostSnapshot], None]) -> Written:
        """Hold a reference to a pool slot (already retained for us); ``release`` gives it back."""
        evicted: list[tuple[HostSnapshot, Callable[[HostSnapshot], None]]] = []
        with self._lock:
            old = self._held.pop(slot.step, None)
            if old is not None:
                evicted.append(old)
            self._copies.pop(slot.step, None)
            self._held[slot.step] = (slot, release)
            evicted.extend(self._evict())
        for held, rel in evicted:
            rel(held)
        return Written(slot.step, slot.nbytes)

    def write(self, snap: StagedSnapshot, deadline: Deadline | None = None) -> Written:
        if deadline is not None:
            deadline.check(f"tier {self.name!r}: write of step {snap.step}")
        with self._lock:
            self._copies[snap.step] = snap.clone()
            evicted = self._evict()
        for held, rel in evicted:
            rel(held)
        return Written(snap.step, snap.nbytes)

    def _evict(self) -> list[tuple[HostSnapshot, Callable[[HostSnapshot], None]]]:
        evicted = []
        while len(self._held) + len(self._copies) > self.keep:
            oldest = min([*self._held, *self._copies])
            if oldest in self._held:
                evicted.append(self._held.pop(oldest))
            else:
                del self._copies[oldest]
        return evicted

    def read(self, step: int) -> StagedSnapshot:
        with self._lock:
            if step in self._held:
                return self._held[step][0].view().clone()
            if step in self._copies:
                return self._copies[step].clone()
        raise CheckpointCorruptError(f"memory tier holds no snapshot of step {step}")

    def holds(self, step: int) -> bool:
        with self._lock:
            return step in self._held or step in self._copies

    def take(self, step: int) -> StagedSnapshot:
        """Hand the snapshot of ``step`` over to the caller without copying.

        The buffers leave the pool for good (the restored training state owns them now) and the step leaves this
        tier. This is what makes a restore from RAM cost almost nothing; a restore calls it only once every rank
        agreed on the step, so a step another rank refused is still here for the next candidate.
        """
        with self._lock:
            held = self._held.pop(step, None)
            if held is None:
                copy = self._copies.pop(step, None)
                if copy is None:
                    raise CheckpointCorruptError(f"memory tier holds no snapshot of step {step}")
                return copy
        slot, release = held
        snap = slot.view()
        slot.handed_over = True
        release(slot)
        return snap

    def list_steps(self) -> list[int]:
        with self._lock:
            return sorted([*self._held, *self._copies])

    def delete(self, step: int) -> None:
        with self._lock:
            held = self._held.pop(step, None)
            self._copies.pop(step, None)
        if held is not None:
            held[1](held[0])

    def reject(self, step: int, reason: str) -> None:
        self.delete(step)  # process memory: nothing outlives the process to record

    def reshard_root(self) -> Path | None:
        return None

    def clear(self) -> None:
        for step in self.list_steps():
            self.delete(step)
