"""MemoryTier: the newest snapshots kept in host RAM, in process memory or in node-local shared memory.

In process memory they serve restores within the process (rollback, retry). With ``shared_memory`` the snapshot
buffers are files in ``/dev/shm`` (:mod:`~lightning_resilience.checkpoint.shared_memory`) that outlive the worker:
a worker restarted on the same node restores the newest step every rank holds from them, without reading disk.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_resilience._configurable import ConfigError, config_from_args
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.shared_store import SharedBuffers, SharedStore
from lightning_resilience.checkpoint.snapshot import (
    HostBuffers,
    HostSnapshot,
    ProcessBuffers,
    StagedSnapshot,
)
from lightning_resilience.checkpoint.tier import Durability, TierIdentity, Written, check_cadence
from lightning_resilience.collective import Deadline

__all__ = ["MemoryTier"]

log = logging.getLogger(__name__)

_Held = tuple[HostSnapshot, Callable[[HostSnapshot], None]]


class MemoryTier:
    """Keeps the last ``keep`` snapshots in host memory (a :class:`~lightning_resilience.checkpoint.tier.RamTier`).

    The manager hands it the snapshot buffers themselves (:meth:`adopt`), so a per-step RAM checkpoint costs no
    second copy; :meth:`read` returns a clone because the buffers are reused once they fall out of the window.

    With ``shared_memory`` the buffers live in ``shm_dir`` and a step is committed there once its copy has landed
    (a marker written last), so a process killed at any instant leaves its newest whole steps for the next one on
    the node. Memory: ``(keep + 2)`` buffers of the training state per rank (``keep`` committed, one being written,
    one a persist may still read), plus, during the first step after a restart, the steps the dead process held.
    When ``shm_dir`` lacks the room (or nothing identifies the run), the tier says so at its first snapshot and keeps
    its buffers in process memory.

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
        shared_memory: bool = False
        """Keep the snapshot buffers in node-local shared memory (``shm_dir``), where they outlive the worker: a
        restarted worker on this node restores the newest step every rank holds, without reading disk. The copy
        costs the same; ``shm_dir`` needs ``keep + 2`` training states of room per rank."""
        shm_dir: str = "/dev/shm"
        """Where shared buffers live: a RAM-backed filesystem local to the node."""
        run_id: str = ""
        """Names the run across restarts (buffers of another run are never restored). Empty: from the environment,
        in order: ``lightning-resilience launch``'s run directory, SLURM_JOB_ID, TORCHELASTIC_RUN_ID (set with
        ``--rdzv-id``), the torchrun agent."""

        def __post_init__(self) -> None:
            check_cadence(f"tiers.{self.name}", self.every_n_steps, self.keep)
            if self.shared_memory and not self.shm_dir:
                raise ConfigError(f"tiers.{self.name}", "shm_dir", "must be a directory when shared_memory is on")

        def build(self) -> MemoryTier:
            return MemoryTier(self)

    durability = Durability.process
    collective = False
    ram = True

    def __init__(self, *args: Any, **settings: Any) -> None:
        self.config = config_from_args(MemoryTier.Config, args, settings, "MemoryTier")
        self.name = self.config.name
        self.every_n_steps = self.config.every_n_steps
        self.keep = self.config.keep
        if self.config.shared_memory:
            self.durability = Durability.host  # until the tier finds it cannot share (then process again)
        self._held: OrderedDict[int, _Held] = OrderedDict()
        self._copies: OrderedDict[int, StagedSnapshot] = OrderedDict()
        self._lock = threading.Lock()
        self._identity = TierIdentity()
        self._shared: SharedStore | None = None

    def __repr__(self) -> str:
        shared = f", shared_memory={self.config.shm_dir!r}" if self.config.shared_memory else ""
        return f"MemoryTier(every_n_steps={self.every_n_steps}, keep={self.keep}{shared})"

    def __getstate__(self) -> dict[str, Any]:
        # held snapshots belong to this process (and a lock cannot be pickled): a spawned copy starts empty
        state = self.__dict__.copy()
        del state["_lock"]
        state["_held"], state["_copies"], state["_shared"] = OrderedDict(), OrderedDict(), None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def bind(self, identity: TierIdentity) -> None:
        self._identity = identity
        if self.config.shared_memory and self._shared is None:
            self._shared = SharedStore.open(self, identity)
            if self._shared is None:
                self.durability = Durability.process

    @property
    def shared_directory(self) -> Path | None:
        """This rank's directory in shared memory (None: the buffers are in process memory)."""
        return self._shared.directory if self._shared is not None else None

    def buffers(self, slots: int) -> HostBuffers:
        """Where the snapshot pool's ``slots`` buffers come from (shared memory when this tier shares)."""
        return SharedBuffers(self, slots) if self.config.shared_memory else ProcessBuffers()

    def adopt(self, slot: HostSnapshot, release: Callable[[HostSnapshot], None]) -> Written:
        """Hold a reference to a pool slot (already retained for us); ``release`` gives it back.

        In shared memory the oldest step goes only once the new one is committed (its copy landed): a kill in the
        middle of the copy still leaves ``keep`` whole steps.
        """
        shared = self._shared
        segment = slot.arena.segment if slot.arena is not None else None
        pending = shared is not None and segment is not None
        evicted: list[_Held] = []
        with self._lock:
            old = self._held.pop(slot.step, None)
            if old is not None:
                evicted.append(old)
            self._copies.pop(slot.step, None)
            self._held[slot.step] = (slot, release)
            evicted.extend(self._evict(self.keep + int(pending)))
        for held in evicted:
            _drop(held)
        if shared is not None:
            shared.first_capture()
            if segment is not None:
                generation, step = slot.generation, slot.step
                slot.when_copied(lambda: shared.commit(slot, segment, generation, step))
        return Written(slot.step, slot.nbytes)

    def write(self, snap: StagedSnapshot, deadline: Deadline | None = None) -> Written:
        if deadline is not None:
            deadline.check(f"tier {self.name!r}: write of step {snap.step}")
        with self._lock:
            self._copies[snap.step] = snap.clone()
            evicted = self._evict()
        for held in evicted:
            _drop(held)
        return Written(snap.step, snap.nbytes)

    def committed(self, step: int) -> None:
        """``step`` is committed in shared memory: the steps beyond ``keep`` can go now."""
        with self._lock:
            evicted = self._evict(self.keep) if step in self._held else []
        for held in evicted:
            _drop(held)

    def _evict(self, limit: int | None = None) -> list[_Held]:
        evicted = []
        while len(self._held) + len(self._copies) > (self.keep if limit is None else limit):
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
        if self._shared is not None and self._shared.holds(step):
            return self._shared.load(step)
        raise CheckpointCorruptError(f"memory tier holds no snapshot of step {step}")

    def holds(self, step: int) -> bool:
        with self._lock:
            if step in self._held or step in self._copies:
                return True
        return self._shared is not None and self._shared.holds(step)

    def take(self, step: int) -> StagedSnapshot:
        """Hand the snapshot of ``step`` over to the caller without copying.

        The buffers leave the pool for good (the restored training state owns them now) and the step leaves this
        tier. This is what makes a restore from RAM cost almost nothing; a restore calls it only once every rank
        agreed on the step, so a step another rank refused is still here for the next candidate. A step a dead
        process left in shared memory is copied out instead, and stays there until this process commits a newer
        one (a crash before that restores it again).
        """
        with self._lock:
            held = self._held.pop(step, None)
            if held is None:
                copy = self._copies.pop(step, None)
                if copy is not None:
                    return copy
        if held is None:
            if self._shared is not None and self._shared.holds(step):
                return self._shared.restore(step)
            raise CheckpointCorruptError(f"memory tier holds no snapshot of step {step}")
        slot, release = held
        snap = slot.view()
        if slot.arena is not None and slot.arena.segment is not None:
            slot.arena.segment.invalidate()  # the training state will change these bytes: no longer a step
        slot.handed_over = True
        release(slot)
        return snap

    def list_steps(self) -> list[int]:
        with self._lock:
            own = {*self._held, *self._copies}
        if self._shared is not None:
            own |= set(self._shared.foreign_steps())
        return sorted(own)

    def delete(self, step: int) -> None:
        with self._lock:
            held = self._held.pop(step, None)
            self._copies.pop(step, None)
        if held is not None:
            _drop(held)
        if self._shared is not None:
            self._shared.forget(step)

    def reject(self, step: int, reason: str) -> None:
        self.delete(step)  # process memory: nothing outlives the process to record

    def reshard_root(self) -> Path | None:
        return None

    def clear(self) -> None:
        for step in self.list_steps():
            self.delete(step)

    def close(self, *, keep: bool) -> None:
        """The engine is done with this tier. ``keep``: leave committed steps in shared memory for the next process
        (a crash, a decided stop); otherwise (the job finished) remove everything this rank holds there."""
        if keep or self._shared is None:
            return
        self.clear()
        self._shared.remove_all()


def _drop(held: _Held) -> None:
    """Give an evicted slot back to the pool; its marker goes first, so its bytes are never taken for that step."""
    slot, release = held
    if slot.arena is not None and slot.arena.segment is not None:
        slot.arena.segment.invalidate()
    release(slot)
