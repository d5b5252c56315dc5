"""MemoryTier: the newest snapshots kept in host RAM, in process memory or in node-local shared memory.

In process memory they serve restores within the process (rollback, retry). With ``shared_memory`` the snapshot
buffers are files in ``/dev/shm`` (:mod:`~lightning_resilience.checkpoint.shared_memory`) that outlive the worker:
a worker restarted on the same node restores the newest step every rank holds from them, without reading disk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_resilience._configurable import ConfigError, config_from_args
from lightning_resilience.checkpoint import shared_memory as shm
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.snapshot import (
    HostArena,
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
        self._shared: _Shared | None = None

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
            self._shared = _Shared.open(self, identity)
            if self._shared is None:
                self.durability = Durability.process

    @property
    def shared_directory(self) -> Path | None:
        """This rank's directory in shared memory (None: the buffers are in process memory)."""
        return self._shared.directory if self._shared is not None else None

    def buffers(self, slots: int) -> HostBuffers:
        """Where the snapshot pool's ``slots`` buffers come from (shared memory when this tier shares)."""
        return _SharedBuffers(self, slots) if self.config.shared_memory else ProcessBuffers()

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


class _SharedBuffers:
    """The pool's arenas in the tier's shared-memory directory; process memory when there is no room (said once)."""

    def __init__(self, tier: MemoryTier, slots: int) -> None:
        self._tier = tier
        self._slots = slots

    def allocate(self, nbytes: int, *, pin: bool) -> HostArena:
        shared = self._tier._shared
        if shared is None or nbytes == 0:
            return ProcessBuffers().allocate(nbytes, pin=pin)
        return shared.allocate(nbytes, self._slots, pin=pin)


class _Shared:
    """The shared-memory side of one bound :class:`MemoryTier`: this rank's directory, the buffers it created, and
    the whole steps that dead processes of this run left there (*foreign* steps)."""

    def __init__(self, tier: MemoryTier, directory: Path, run_key: str, identity: TierIdentity) -> None:
        self.tier = tier
        self.directory = directory
        self.run_key = run_key
        self.identity = identity
        self._lock = threading.Lock()
        self._segments: list[shm.Segment] = []
        self._foreign: dict[int, shm.Held] = {}
        self._restored: int | None = None
        """The foreign step this process restored; kept until a newer step of its own is committed."""
        self._captured = False
        self._disabled = False
        self._checked = False

    @classmethod
    def open(cls, tier: MemoryTier, identity: TierIdentity) -> _Shared | None:
        """Bind ``tier`` to its shared-memory directory: sweep stale runs, find the foreign steps, remove torn ones.
        None (after a warning) when the run cannot be identified or the directory cannot be used."""
        root = Path(tier.config.shm_dir)
        key = shm.resolve_run_key(tier.config.run_id)
        where = f"tier {tier.name!r}"
        if key is None:  # no launcher restarts this process: said, but not as a warning
            log.info(
                "%s: nothing identifies this run across restarts (no run_id, no launcher, scheduler or torchrun run "
                "id): snapshots stay in process memory; set run_id to keep them in %s", where, root
            )  # fmt: skip
            return None
        run_key, source = key
        directory = shm.rank_directory(root, run_key, identity.rank)
        try:
            shm.sweep_stale_runs(root, run_key)
            held, doomed = shm.scan(directory, world_size=identity.world_size)
            shm.remove_files(doomed)
        except OSError as err:
            log.warning("%s: %s is not usable (%s): snapshots stay in process memory", where, root, err)
            return None
        shared = cls(tier, directory, run_key, identity)
        for h in sorted(held, key=lambda h: h.written):
            old = shared._foreign.get(h.step)
            if old is not None:  # two dead processes held the same step: the newer copy wins
                shm.remove_files([old.data, old.marker])
            shared._foreign[h.step] = h
        if shared._foreign:
            log.info("%s: steps %s of this run are in shared memory (%s)", where, sorted(shared._foreign), directory)
        log.debug("%s: run identified by %s", where, source)
        return shared

    # ------------------------------------------------------------------ buffers
    def allocate(self, nbytes: int, slots: int, *, pin: bool) -> HostArena:
        with self._lock:
            if not self._disabled and not self._checked:
                self._checked = True
                need, free = nbytes * slots, shm.free_bytes(self.directory)
                if free < need:
                    self._disable(
                        f"{self.directory.parent.parent.parent} has {free / 2**20:.0f} MiB free, {slots} buffers of "
                        f"{nbytes / 2**20:.1f} MiB need {need / 2**20:.0f} MiB"
                    )
            if not self._disabled:
                try:
                    segment = shm.Segment(self.directory, nbytes, len(self._segments), pin=pin)
                except OSError as err:
                    self._disable(f"a buffer of {nbytes / 2**20:.1f} MiB could not be created ({err})")
                else:
                    self._segments.append(segment)
                    return HostArena(segment.data, segment)
        return ProcessBuffers().allocate(nbytes, pin=pin)

    def _disable(self, why: str) -> None:
        self._disabled = True
        self.tier.durability = Durability.process
        log.warning(
            "tier %r: snapshots stay in process memory: %s (raise the size of the shared-memory filesystem, lower "
            "keep, or set shared_memory=false); a process crash falls back to the next tier", self.tier.name, why
        )  # fmt: skip

    # ------------------------------------------------------------------ commits
    def commit(self, slot: HostSnapshot, segment: shm.Segment, generation: int, step: int) -> None:
        """Runs once the copy of ``step`` into ``slot`` has landed: write its marker (unless the slot was written
        again or evicted since), then drop the foreign step this process restored, now superseded."""
        if slot.generation != generation:
            return  # written again since: that copy commits its own step
        marker = {
            "run": self.run_key,
            "rank": self.identity.rank,
            "world_size": self.identity.world_size,
            "step": step,
            "tensors": slot.tensor_layout(),
            "skeleton": slot.skeleton,
            "meta": slot.meta,
            "written": time.time(),
        }
        try:
            committed = segment.commit(generation, marker)
        except (OSError, TypeError, ValueError) as err:  # never fail training over a marker: the step is just not kept
            log.warning("tier %r: step %d not kept in shared memory (%s)", self.tier.name, step, err)
            self.tier.committed(step)  # the window stays bounded: the older steps go all the same
            return
        if committed:
            self.tier.committed(step)
            with self._lock:
                superseded = self._restored is not None and step > self._restored
                if superseded:
                    self._restored = None
            if superseded:
                self._drop_foreign(lambda s: True)

    def first_capture(self) -> None:
        """This process captured its first step: foreign steps other than the one it restored belong to a timeline
        it does not continue."""
        if self._captured:
            return
        self._captured = True
        restored = self._restored
        self._drop_foreign(lambda s: s != restored)

    # ------------------------------------------------------------------ foreign steps
    def foreign_steps(self) -> list[int]:
        with self._lock:
            return sorted(self._foreign)

    def holds(self, step: int) -> bool:
        with self._lock:
            return step in self._foreign

    def load(self, step: int) -> StagedSnapshot:
        """A copy of foreign ``step``, read from its mapped buffer.

        Raises:
            CheckpointCorruptError: its buffer or marker is gone or does not match.
        """
        with self._lock:
            held = self._foreign.get(step)
        if held is None:
            raise CheckpointCorruptError(f"memory tier holds no snapshot of step {step}")
        try:
            info, tensors = shm.map_held(held)
        except (OSError, ValueError) as err:
            raise CheckpointCorruptError(f"{held.marker}: shared-memory snapshot unreadable ({err})") from err
        if int(info["step"]) != step or int(info["rank"]) != self.identity.rank:
            raise CheckpointCorruptError(f"{held.marker}: marker is for step {info['step']} rank {info['rank']}")
        owned = {name: t.clone() for name, t in tensors.items()}
        return StagedSnapshot(step, info["skeleton"], owned, dict(info.get("meta") or {}))

    def restore(self, step: int) -> StagedSnapshot:
        """Foreign ``step``, agreed by every rank: a copy of it; the other foreign steps go (that timeline is not
        continued), this one stays until this process commits a newer step."""
        snap = self.load(step)
        with self._lock:
            self._restored = step
        self._drop_foreign(lambda s: s != step)
        return snap

    def forget(self, step: int) -> None:
        self._drop_foreign(lambda s: s == step)

    def _drop_foreign(self, doomed: Callable[[int], bool]) -> None:
        with self._lock:
            gone = [self._foreign.pop(s) for s in list(self._foreign) if doomed(s)]
        shm.remove_files([p for h in gone for p in (h.marker, h.data)])

    def remove_all(self) -> None:
        """The job is over: this rank's buffers and directory go, and the run's directory with the last rank."""
        self._drop_foreign(lambda s: True)
        with self._lock:
            segments, self._segments = self._segments, []
        for segment in segments:
            segment.remove()
        for directory in (self.directory, self.directory.parent):
            try:
                directory.rmdir()
            except OSError:
                break  # not empty: another rank (or a leftover) is still there
