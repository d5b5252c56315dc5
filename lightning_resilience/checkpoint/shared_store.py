"""The shared-memory side of a :class:`~lightning_resilience.checkpoint.memory.MemoryTier` with ``shared_memory``:
this rank's directory of buffers (:mod:`~lightning_resilience.checkpoint.shared_memory`), the markers that commit
its steps, and the whole steps that dead processes of the same run left there (*foreign* steps)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_resilience.checkpoint import shared_memory as shm
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.filesystems import warn_unless_in_ram
from lightning_resilience.checkpoint.snapshot import HostArena, HostSnapshot, ProcessBuffers, StagedSnapshot
from lightning_resilience.checkpoint.tier import Durability, TierIdentity

if TYPE_CHECKING:
    from lightning_resilience.checkpoint.memory import MemoryTier

__all__ = ["SharedBuffers", "SharedStore"]

log = logging.getLogger(__name__)


class SharedBuffers:
    """The pool's arenas in the tier's shared-memory directory; process memory when there is no room (said once)."""

    def __init__(self, tier: MemoryTier, slots: int) -> None:
        self._tier = tier
        self._slots = slots

    def allocate(self, nbytes: int, *, pin: bool) -> HostArena:
        shared = self._tier._shared
        if shared is None or nbytes == 0:
            return ProcessBuffers().allocate(nbytes, pin=pin)
        return shared.allocate(nbytes, self._slots, pin=pin)


class SharedStore:
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
    def open(cls, tier: MemoryTier, identity: TierIdentity) -> SharedStore | None:
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
        warn_unless_in_ram(root, f"tiers.{tier.name}.shm_dir", "the kernel writes every snapshot's pages back to it")
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
                    segment = shm.Segment(self.directory, nbytes, pin=pin)
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
        """A foreign step whose marker still vouches for its buffer (checked now: the restore agrees on it next)."""
        with self._lock:
            held = self._foreign.get(step)
        return held is not None and shm.vouches(held)

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
