"""Host snapshots: pre-allocated, reusable host buffers that hold one rank's training state at one step.

Only the copy into these buffers blocks the training thread. A :class:`SnapshotPool` owns a small ring of
buffer sets; a slot is reused only when no tier still needs it (reference counted), so the step after a
snapshot runs while the snapshot is persisted (double buffering) and the RAM tier keeps its newest copies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from lightning_resilience.checkpoint.tree import FlatState, TensorSpec

__all__ = ["HostSnapshot", "SnapshotPool", "StagedSnapshot"]


@dataclass
class StagedSnapshot:
    """A readable view of one snapshot: step, JSON-safe skeleton, host tensors and metadata."""

    step: int
    skeleton: Any
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

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


class _CopyJob:
    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs = pairs
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout: timedelta) -> None:
        if not self.done.wait(timeout.total_seconds()):
            raise TimeoutError(f"host snapshot copy did not finish within {timeout}")
        if self.error is not None:
            raise RuntimeError(f"host snapshot copy failed: {self.error}") from self.error


class _Copier:
    """One owned thread that copies into host buffers while the training thread runs the next step.

    ``Tensor.copy_`` releases the GIL, so the copy really runs beside the forward and backward passes.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[_CopyJob] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> _CopyJob:
        job = _CopyJob(pairs)
        with self._cond:
            if self._closed:
                raise RuntimeError("snapshot copier is closed")
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="lr-snapshot-copy", daemon=True)
                self._thread.start()
            self._queue.append(job)
            self._cond.notify_all()
        return job

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.pop(0)
            try:
                for dst, src in job.pairs:
                    dst.copy_(src)
            except BaseException as err:  # surfaced by job.wait() on the training thread
                job.error = err
            finally:
                job.done.set()

    def close(self, timeout: timedelta) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout.total_seconds())


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
    """One set of host buffers, laid out for a given set of tensor specs and reused across steps."""

    def __init__(self, *, pin_memory: bool) -> None:
        self._pin = pin_memory
        self._buffers: dict[str, torch.Tensor] = {}
        self._signature: tuple[Any, ...] = ()
        self._nbytes = 0
        self._event: torch.cuda.Event | None = None
        self._job: _CopyJob | None = None
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
        specs = flat.specs()
        # the layout changes rarely (optimizer state appears after the first step); reuse what still fits
        fresh: dict[str, torch.Tensor] = {}
        for name, spec in specs.items():
            old = self._buffers.get(name)
            if old is not None and tuple(old.shape) == spec.shape and old.dtype == spec.dtype:
                fresh[name] = old
            else:
                fresh[name] = torch.empty(spec.shape, dtype=spec.dtype, pin_memory=self._pin)
        self._buffers = fresh
        self._nbytes = sum(b.numel() * b.element_size() for b in fresh.values())
        self.reallocations += 1

    def copy_from(
        self,
        step: int,
        flat: FlatState,
        meta: dict[str, Any],
        stream: torch.cuda.Stream | None,
        *,
        overlap: Callable[[torch.Tensor], bool] | None = None,
        copier: _Copier | None = None,
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
            for name, src in flat.tensors.items():
                if copier is not None and overlap is not None and overlap(src):
                    deferred.append((self._buffers[name], src))
                else:
                    self._buffers[name].copy_(src)
            self._job = copier.submit(deferred) if deferred and copier is not None else None
        self.step = step
        self.skeleton = flat.skeleton
        self.meta = dict(meta)

    def _queue_copies(self, pairs: list[tuple[str, torch.Tensor]], stream: torch.cuda.Stream) -> None:
        for name, src in pairs:
            if src.is_cuda:
                src.record_stream(stream)  # a temporary source must outlive the copy that reads it
            self._buffers[name].copy_(src, non_blocking=src.is_cuda)

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

    def view(self) -> StagedSnapshot:
        self.wait_copied()
        return StagedSnapshot(self.step, self.skeleton, dict(self._buffers), dict(self.meta))

    @property
    def nbytes(self) -> int:
        return self._nbytes  # summed once per layout: hundreds of buffers, read several times a step


class SnapshotPool:
    """A bounded ring of :class:`HostSnapshot` slots, handed out by reference count.

    Args:
        max_slots: upper bound on host copies; the pool grows lazily up to it.
        pin_memory: pin host buffers (only meaningful, and only used, when CUDA is present).
    """

    def __init__(self, *, max_slots: int, pin_memory: bool | None = None) -> None:
        if max_slots < 2:
            raise ValueError(f"snapshot max_slots must be >= 2 for double buffering, got {max_slots}")
        self._max = max_slots
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory and torch.cuda.is_available()
        self._slots: list[HostSnapshot] = []
        self._cond = threading.Condition()
        self._stream: torch.cuda.Stream | None = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._copier = _Copier()
        self._inflight: HostSnapshot | None = None

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
                    slot = HostSnapshot(pin_memory=self._pin)
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
                self._cond.notify_all()
