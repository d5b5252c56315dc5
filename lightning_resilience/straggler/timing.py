"""Per-rank timing of training steps, of named sections inside them, and of the gaps between them.

Host sections are timed with a wall clock (injectable, so tests drive time by hand); on a GPU, sections can be timed
with CUDA events instead (device time, read back lazily so timing never synchronizes the step).

Besides the sections a caller names, every step yields

* ``step``: start of the step to its end;
* ``data``: end of the previous step (or of the exchange after it) to the start of this one: the wait for the next
  batch. With CUDA events it is the device's idle gap between the two steps, which is what a slow loader costs;
* ``wait``: the collective wait inside the step (time blocked on other ranks), summed over the spans a probe marks
  (see :mod:`lightning_resilience.straggler.probes`);
* ``compute``: ``step - wait``, the rank's own work (forward, backward compute, optimizer, hooks).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = [
    "BACKWARD",
    "COMPUTE",
    "DATA",
    "FORWARD",
    "OPTIMIZER",
    "STEP",
    "WAIT",
    "CudaEventSource",
    "StepTimer",
    "TimeSource",
    "WallClockSource",
]

STEP = "step"
"""Whole step: its start to its end."""
DATA = "data"
"""Wait for data: end of the previous step (after the exchange of timings) to the start of this one."""
WAIT = "wait"
"""Collective wait inside the step: time blocked on the other ranks (DDP's gradient sync, FSDP's gathers)."""
COMPUTE = "compute"
"""The rank's own work in the step: ``step - wait``."""
FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
"""Sections the Lightning callback times from the trainer's hooks."""
DERIVED = (COMPUTE,)
"""Sections computed from the others, never opened by name."""


class TimeSource(Protocol):
    """Where time marks come from: ``mark`` is cheap and called inside the step; ``elapsed`` may block and is called
    only when timings are collected."""

    def mark(self) -> Any: ...

    def ready(self, mark: Any) -> bool:
        """Whether ``mark`` can be read without waiting."""
        ...

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds between two marks of this source."""
        ...


class WallClockSource:
    """Host wall clock (``time.perf_counter`` unless a clock is injected)."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock or time.perf_counter

    def mark(self) -> float:
        return self.clock()

    def ready(self, mark: float) -> bool:
        return True

    def elapsed(self, start: float, end: float) -> float:
        return end - start


class CudaEventSource:
    """CUDA events recorded on the current stream: device time, read back at collection time (never waited for:
    :meth:`StepTimer.collect` takes only the steps whose events have completed)."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaEventSource needs a CUDA device; use WallClockSource on CPU")

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ready(self, mark: torch.cuda.Event) -> bool:
        return bool(mark.query())

    def elapsed(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        if not end.query():  # only with collect(wait=True): collect() otherwise takes finished steps only
            end.synchronize()
        return float(start.elapsed_time(end)) / 1e3


@dataclass
class _PendingStep:
    spans: list[tuple[str, Any, Any]] = field(default_factory=list)
    label: int | None = None
    """The caller's name for the step (its step number): :meth:`StepTimer.label_finished`."""


class StepTimer:
    """Times steps, named sections and the gaps between steps; ``collect`` turns the finished steps into
    ``{section: seconds}`` records.

    Example::

        timer = StepTimer()
        timer.start_step()
        with timer.section("forward"):
            loss = model(batch)
        timer.end_step()
        timer.collect()  # [{"step": 0.012, "forward": 0.004, "compute": 0.012, "data": 0.001}]

    A section entered several times in one step counts the sum. Sections still open at ``end_step`` close there.

    Args:
        source: marks for the step, its sections and the gaps (default: the host wall clock ``clock``).
        clock: host clock of the default source.
    """

    def __init__(self, source: TimeSource | None = None, *, clock: Callable[[], float] | None = None) -> None:
        self.source: TimeSource = source or WallClockSource(clock)
        self._current: _PendingStep | None = None
        self._step_start: Any = None
        self._open: dict[str, Any] = {}
        self._finished: list[_PendingStep] = []
        self._idle_since: Any = None

    @property
    def in_step(self) -> bool:
        return self._current is not None

    def start_step(self) -> None:
        if self._current is not None:  # the previous step never ended (an exception, a skipped hook): drop it
            self._open.clear()
        self._current = _PendingStep()
        self._step_start = self.source.mark()
        if self._idle_since is not None:
            self._current.spans.append((DATA, self._idle_since, self._step_start))
            self._idle_since = None

    def begin(self, name: str) -> None:
        """Open section ``name`` (no-op outside a step)."""
        if self._current is None:
            return
        if name in self._open:
            raise RuntimeError(f"section {name!r} is already open: sections with the same name cannot nest")
        self._open[name] = self.source.mark()

    def end(self, name: str) -> None:
        """Close section ``name`` (no-op if it is not open)."""
        start = self._open.pop(name, None)
        if start is None or self._current is None:
            return
        self._current.spans.append((name, start, self.source.mark()))

    def is_open(self, name: str) -> bool:
        return name in self._open

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    def end_step(self) -> None:
        if self._current is None:
            return
        end = self.source.mark()
        for name, start in self._open.items():
            self._current.spans.append((name, start, end))
        self._open.clear()
        self._current.spans.append((STEP, self._step_start, end))
        self._finished.append(self._current)
        self._current = None
        self._idle_since = end

    def mark_idle(self) -> None:
        """The wait for the next batch starts now (after work between steps that is not a data wait, such as the
        exchange of timings)."""
        if self._current is None:
            self._idle_since = self.source.mark()

    def cancel_step(self) -> None:
        """Forget the step in progress (e.g. a gradient-accumulation micro-batch that is not a full step)."""
        self._current = None
        self._open.clear()

    def reset_data_wait(self) -> None:
        """The next step's data wait is not measured (after a pause such as validation or a checkpoint)."""
        self._idle_since = None

    def label_finished(self, label: int) -> None:
        """Name the steps finished since the last call (normally the one just ended) ``label``; :meth:`collect_labelled`
        gives the names back."""
        for pending in reversed(self._finished):
            if pending.label is not None:
                return
            pending.label = label

    def collect(self, *, wait: bool = False) -> list[dict[str, float]]:
        """Seconds per section of every step finished since the last call, oldest first.

        With CUDA events, a step whose work is still running on the device stays for the next call unless ``wait``
        (timing never stalls the host on the device).
        """
        return [record for _, record in self.collect_labelled(wait=wait)]

    def collect_labelled(self, *, wait: bool = False) -> list[tuple[int | None, dict[str, float]]]:
        """:meth:`collect`, each record with its step's name (:meth:`label_finished`; None: never named)."""
        out: list[tuple[int | None, dict[str, float]]] = []
        done = 0
        for pending in self._finished:
            if not wait and not all(self.source.ready(end) for _, _, end in pending.spans):
                break
            done += 1
            record: dict[str, float] = {}
            for name, start, end in pending.spans:
                record[name] = record.get(name, 0.0) + max(0.0, self.source.elapsed(start, end))
            record[COMPUTE] = max(0.0, record[STEP] - record.get(WAIT, 0.0))
            out.append((pending.label, record))
        del self._finished[:done]
        return out
