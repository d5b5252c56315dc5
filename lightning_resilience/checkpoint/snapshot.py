"""Host snapshots: pre-allocated, reusable host buffers that hold one rank's training state at one step.

Only the copy into these buffers blocks the training thread. A :class:`SnapshotPool` owns a small ring of
buffer sets; a slot is reused only when no tier still needs it (reference counted), so the step after a
snapshot runs while the snapshot is persisted (double buffering) and the RAM tier keeps its newest copies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lightning_resilience.checkpoint import host_copy
from lightning_resilience.checkpoint.host_copy import Copier, CopyJob
from lightning_resilience.checkpoint.shard_writer import FilePlan
from lightning_resilience.checkpoint.tree import FlatState, TensorSpec

if TYPE_CHECKING:
    from lightning_resilience.checkpoint.shared_memory import Segment

__all__ = [
    "HostArena",
    "HostBuffers",
    "HostSnapshot",
    "ProcessBuffers",
    "ShardWriter",
    "SharedSource",
    "SnapshotPool",
    "StagedSnapshot",
]

log = logging.getLogger(__name__)

ALIGN = 64
"""Byte alignment of every tensor in a slot's arena (a cache line; enough for any dtype)."""


class ShardWriter(Protocol):
    """Writes a shard's data files from a snapshot in shared memory, in another process
    (:class:`~lightning_resilience.checkpoint.worker.WriterProcess`)."""

    def write_files(
        self, directory: Path, segment: Path, offsets: list[int], plans: list[FilePlan], extra: dict[str, bytes]
    ) -> dict[str, dict[str, Any]]:
        """Create ``directory`` and write ``plans`` (tensor ``i`` at ``offsets[i]`` of ``segment``) and ``extra``
        into it, fsynced; returns each file's size and checksum.

        Raises:
            OSError: a disk fault (its errno kept), or the writer process died.
        """


@dataclass(frozen=True)
class SharedSource:
    """Where a snapshot's bytes lie in shared memory: another process (the writer) can map ``path`` and find each
    tensor at ``offsets[name]``."""

    path: Path
    offsets: dict[str, int]


@dataclass
class StagedSnapshot:
    """A readable view of one snapshot: step, JSON-safe skeleton, host tensors and metadata."""

    step: int
    skeleton: Any
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)
    shared: SharedSource | None = None
    """Set when the tensors are views of a shared-memory buffer (a writer process can read them there)."""
    writer: ShardWriter | None = None
    """The process that writes this snapshot's files from ``shared`` (None: the caller's thread writes them)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def specs(self) -> dict[str, TensorSpec]:
        return {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in self.tensors.items()}

    def clone(self) -> StagedSnapshot:
        """A copy that owns its tensors (a restored state must never alias a buffer that is reused later)."""
        return StagedSnapshot(
            step=self.step,
            skeleton=self.skeleton,
            tensors={n: t.clone() for n, t in self.tensors.items()},
            meta=dict(self.meta),
        )


class HostArena:
    """The flat host buffer behind one snapshot slot; every tensor of the slot is a view into it.

    ``segment`` is the shared-memory file behind it (a restarted worker can read it), None for process memory.
    """

    def __init__(self, data: torch.Tensor, segment: Segment | None = None) -> None:
        self.data = data
        self.segment = segment

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def release(self) -> None:
        """The pool no longer uses this arena (tensors that still view it stay valid)."""
        if self.segment is not None:
            self.segment.remove()


class HostBuffers(Protocol):
    """Where a pool's slots get their arenas: process memory (:class:`ProcessBuffers`) or a RAM tier's shared
    memory (:class:`~lightning_resilience.checkpoint.memory.MemoryTier` with ``shared_memory``)."""

    def allocate(self, nbytes: int, *, pin: bool) -> HostArena:
        """A new arena of ``nbytes`` (page-locked when ``pin``); never raises for lack of room in shared memory:
        it falls back to process memory."""


class ProcessBuffers:
    """Arenas in this process's memory (pinned on a GPU machine)."""

    def allocate(self, nbytes: int, *, pin: bool) -> HostArena:
        return HostArena(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin))


def _split(
    flat: FlatState, overlap: Callable[[torch.Tensor], bool] | None
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """(copied before the next forward, copied beside it) pairs of name and source tensor."""
    now: list[tuple[str, torch.Tensor]] = []
    later: list[tuple[str, torch.Tensor]] = []
    for name, src in flat.tensors.items():
        (later if overlap is not None and overlap(src) else now).append((name, src))
    return now, later


class HostSnapshot:
    """One set of host buffers, laid out for a given set of tensor specs in one arena and reused across steps."""

    def __init__(self, *, pin_memory: bool, buffers: HostBuffers | None = None) -> None:
        self._pin = pin_memory
        self._source = buffers or ProcessBuffers()
        self.arena: HostArena | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._exposed: dict[str, torch.Tensor] = {}
        self.offsets: dict[str, int] = {}
        """Where each tensor starts in the arena (bytes)."""
        self._signature: tuple[Any, ...] = ()
        self._nbytes = 0
        self._event: torch.cuda.Event | None = None
        self._job: CopyJob | None = None
        self._copier: Copier | None = None
        self.generation = 0
        """Changes with every copy into this slot (see :meth:`when_copied`)."""
        self.step = -1
        self.skeleton: Any = None
        self.meta: dict[str, Any] = {}
        self.refs = 0
        self.handed_over = False
        self.reallocations = 0

    def _ensure_layout(self, flat: FlatState) -> None:
        # a cheap signature first: building TensorSpecs for hundreds of tensors every step costs milliseconds
        signature = tuple((n, t.shape, t.dtype) for n, t in flat.tensors.items())
        if signature == self._signature:
            return
        self._signature = signature
        # the layout changes rarely (optimizer state appears after the first step): one arena, views into it
        offsets: dict[str, int] = {}
        total = 0
        for name, t in flat.tensors.items():
            offsets[name] = total
            total = _align(total + t.numel() * t.element_size())
        if self.arena is None or self.arena.nbytes < total:
            if self.arena is not None:
                self.arena.release()
            self.arena = self._source.allocate(total, pin=self._pin)
        arena, memory = self.arena.data, self.arena.data.numpy()
        self._buffers, self._exposed = {}, {}
        for name, t in flat.tensors.items():
            start, size = offsets[name], t.numel() * t.element_size()
            if not size:
                self._buffers[name] = self._exposed[name] = torch.empty(t.shape, dtype=t.dtype)
                continue
            # copies go into views of the arena (a pinned arena stays pinned to the copy engine); what the slot hands
            # out has a storage of its own over the same bytes, as a plain tensor has: a consumer that reads a
            # tensor's storage (torch.set_rng_state, torch.save) sees this tensor and nothing around it
            self._buffers[name] = arena[start : start + size].view(t.dtype).view(t.shape)
            self._exposed[name] = torch.from_numpy(memory[start : start + size]).view(t.dtype).view(t.shape)
        self.offsets = offsets
        self._nbytes = sum(b.numel() * b.element_size() for b in self._buffers.values())
        self.reallocations += 1

    def copy_from(
        self,
        step: int,
        flat: FlatState,
        meta: dict[str, Any],
        stream: torch.cuda.Stream | None,
        *,
        overlap: Callable[[torch.Tensor], bool] | None = None,
        copier: Copier | None = None,
    ) -> None:
        """Copy ``flat``'s tensors into this slot.

        With a CUDA stream the device-to-host copies are queued on it without blocking the CPU: the training stream
        waits at once only for the tensors the next forward may change (``overlap`` false: buffers, temporaries);
        the copies of the others (parameters, optimizer state) run beside the next forward and backward, and
        :meth:`order_after_copy` makes the training stream wait for them right before the optimizer changes them.
        On the CPU, tensors for which ``overlap`` is true are copied by ``copier`` in the background; the rest now.
        Either way :meth:`wait_copied` waits (on the host) for completion.
        """
        if stream is None:
            self.wait_copied()  # on a GPU the new copies queue behind the old ones on the same stream
        self._ensure_layout(flat)
        assert self.arena is not None
        segment = self.arena.segment
        # no marker may vouch for a buffer being written: a shared arena drops its marker first
        self.generation = segment.invalidate() if segment is not None else self.generation + 1
        self._copier = copier
        if stream is not None:
            current = torch.cuda.current_stream()
            stream.wait_stream(current)
            now, later = _split(flat, overlap)
            with torch.cuda.stream(stream):
                self._queue_copies(now, stream)
                if now and later:
                    ready = torch.cuda.Event()
                    ready.record(stream)
                    # the next forward may change these (buffers) or free them (temporaries): it waits for them
                    current.wait_event(ready)
                self._queue_copies(later, stream)
                self._event = torch.cuda.Event()
                self._event.record(stream)
            if not later:
                current.wait_event(self._event)  # nothing overlaps: later kernels wait for the whole copy
            self._job = None
        else:
            self._event = None
            deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
            at_once: list[tuple[torch.Tensor, torch.Tensor]] = []
            background = copier is not None and overlap is not None
            for name, src in flat.tensors.items():
                (deferred if background and overlap(src) else at_once).append((self._buffers[name], src))  # type: ignore[misc]
            host_copy.copy_pairs(at_once)
            self._job = copier.submit(CopyJob(deferred)) if deferred and copier is not None else None
        self.step = step
        self.skeleton = flat.skeleton
        self.meta = dict(meta)

    def _queue_copies(self, pairs: list[tuple[str, torch.Tensor]], stream: torch.cuda.Stream) -> None:
        for name, src in pairs:
            if src.is_cuda:
                src.record_stream(stream)  # a temporary source must outlive the copy that reads it
            self._buffers[name].copy_(src, non_blocking=src.is_cuda)

    def when_copied(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once every copy into this slot has landed, off the training thread when the copy runs
        in the background (on the copier thread, after a CPU copy or the CUDA copy's event). A callback that must
        not act on a later copy compares :attr:`generation` with the one it saw."""
        job, event, copier = self._job, self._event, self._copier
        if event is not None and copier is not None:
            waiter = CopyJob([], event)
            waiter.then.append(callback)
            copier.submit(waiter)
        elif job is not None and copier is not None:
            copier.then(job, callback)
        else:
            callback()

    def wait_copied(self, timeout: timedelta = timedelta(seconds=300)) -> None:
        """Block (bounded) until every copy into this slot has landed."""
        # called from the training thread and the persist worker alike; waiting on a completed handle is free
        event, job = self._event, self._job
        if event is not None:
            event.synchronize()
        if job is not None:
            job.wait(timeout)

    def order_after_copy(self, timeout: timedelta = timedelta(seconds=300)) -> None:
        """Make what the training thread does next come after every copy into this slot.

        On a GPU the current stream waits for the copy's event (the CPU is not blocked and nothing is read back);
        on the CPU this waits for the background copy like :meth:`wait_copied`.
        """
        event, job = self._event, self._job
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        if job is not None:
            job.wait(timeout)

    def tensor_layout(self) -> dict[str, tuple[int, list[int], str]]:
        """Each tensor's offset in the arena, shape and dtype name (without waiting for the copy)."""
        return {
            name: (self.offsets[name], list(t.shape), str(t.dtype).removeprefix("torch."))
            for name, t in self._buffers.items()
        }

    def view(self, writer: ShardWriter | None = None) -> StagedSnapshot:
        """The slot's content (after its copy landed); ``writer`` writes it from shared memory when it is there."""
        self.wait_copied()
        segment = self.arena.segment if self.arena is not None else None
        shared = None
        if segment is not None:  # the file holds a header before the arena
            shared = SharedSource(segment.path, {n: segment.base + o for n, o in self.offsets.items()})
        return StagedSnapshot(
            self.step,
            self.skeleton,
            dict(self._exposed),
            dict(self.meta),
            shared=shared,
            writer=writer if shared else None,
        )

    def release_arena(self) -> None:
        """The pool drops this slot: its arena goes (tensors handed over keep viewing it)."""
        if self.arena is not None:
            self.arena.release()

    @property
    def nbytes(self) -> int:
        return self._nbytes  # summed once per layout: hundreds of buffers, read several times a step


def _align(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


class SnapshotPool:
    """A bounded ring of :class:`HostSnapshot` slots, handed out by reference count.

    Args:
        max_slots: upper bound on host copies; the pool grows lazily up to it.
        pin_memory: pin host buffers (only meaningful, and only used, when CUDA is present).
        buffers: where slots get their arenas (default: process memory).
    """

    def __init__(self, *, max_slots: int, pin_memory: bool | None = None, buffers: HostBuffers | None = None) -> None:
        if max_slots < 2:
            raise ValueError(f"snapshot max_slots must be >= 2 for double buffering, got {max_slots}")
        self._max = max_slots
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory and torch.cuda.is_available()
        self._slots: list[HostSnapshot] = []
        self._cond = threading.Condition()
        self._stream: torch.cuda.Stream | None = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._copier = Copier()
        self._inflight: HostSnapshot | None = None
        self._buffers = buffers or ProcessBuffers()

    @property
    def max_slots(self) -> int:
        return self._max

    @property
    def pinned(self) -> bool:
        return self._pin

    @property
    def host_bytes(self) -> int:
        return sum(s.nbytes for s in self._slots)

    def capture(
        self,
        step: int,
        flat: FlatState,
        meta: dict[str, Any],
        *,
        timeout: timedelta = timedelta(seconds=60),
        overlap: Callable[[torch.Tensor], bool] | None = None,
    ) -> HostSnapshot:
        """Copy ``flat`` into a free slot and return it holding one reference (the caller's).

        Waits (bounded) only when every slot is still referenced, which a correctly sized pool avoids. Tensors for
        which ``overlap`` is true are copied in the background: the caller must call :meth:`order_inflight` (or
        :meth:`wait_inflight`) before it next changes them (the next optimizer step).

        Raises:
            TimeoutError: no slot was released within ``timeout``.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        with self._cond:
            while True:
                free = [s for s in self._slots if s.refs == 0]
                if free:
                    slot = min(free, key=lambda s: s.step)
                    break
                if len(self._slots) < self._max:
                    slot = HostSnapshot(pin_memory=self._pin, buffers=self._buffers)
                    self._slots.append(slot)
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._cond.wait(remaining):
                    raise TimeoutError(
                        f"no free host snapshot slot within {timeout}; raise snapshot.max_host_copies "
                        f"(now {self._max}) or persist less often"
                    )
            slot.refs = 1
        self.order_inflight(timeout)
        slot.copy_from(step, flat, meta, self._stream, overlap=overlap, copier=self._copier)
        self._inflight = slot
        return slot

    def wait_inflight(self, timeout: timedelta = timedelta(seconds=300)) -> None:
        """Wait (on the host) until the newest capture's background copy is complete."""
        slot, self._inflight = self._inflight, None
        if slot is not None:
            slot.wait_copied(timeout)

    def order_inflight(self, timeout: timedelta = timedelta(seconds=300)) -> None:
        """Order what the training thread does next after the newest capture's copy (call before the tensors it
        reads change: the optimizer step). On a GPU the current stream waits for the copy; the CPU does not."""
        slot, self._inflight = self._inflight, None
        if slot is not None:
            slot.order_after_copy(timeout)

    def close(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        self.wait_inflight(timeout)
        self._copier.close(timeout)
        with self._cond:
            for slot in self._slots:
                if slot.refs == 0:  # a slot still referenced (a RAM tier's) is the tier's to discard
                    slot.release_arena()

    def retain(self, slot: HostSnapshot) -> None:
        with self._cond:
            assert slot.refs > 0, "retain of a released snapshot slot"
            slot.refs += 1

    def release(self, slot: HostSnapshot) -> None:
        with self._cond:
            assert slot.refs > 0, "double release of a snapshot slot"
            slot.refs -= 1
            if slot.refs == 0:
                if slot.handed_over and slot in self._slots:
                    # its buffers now belong to a restored training state: never reuse them
                    self._slots.remove(slot)
                    slot.release_arena()
                self._cond.notify_all()
