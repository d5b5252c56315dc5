"""The background copy of a snapshot: one owned thread that copies into host buffers while the training thread runs
the next step, and runs what must follow a copy (a shared-memory snapshot's marker) once it has landed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

import torch

__all__ = ["CopyJob", "Copier", "copy_pairs"]

log = logging.getLogger(__name__)


class CopyJob:
    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], event: torch.cuda.Event | None = None) -> None:
        self.pairs = pairs
        self.event = event
        self.then: list[Callable[[], None]] = []
        self.sealed = False
        """Set by the copier once it has run every callback: a later one runs on the caller."""
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout: timedelta) -> None:
        if not self.done.wait(timeout.total_seconds()):
            raise TimeoutError(f"host snapshot copy did not finish within {timeout}")
        if self.error is not None:
            raise RuntimeError(f"host snapshot copy failed: {self.error}") from self.error


class Copier:
    """One owned thread that copies into host buffers while the training thread runs the next step, and runs what
    must follow a copy (a shared-memory snapshot's marker) once it has landed.

    ``Tensor.copy_`` releases the GIL, so the copy really runs beside the forward and backward passes.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[CopyJob] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, job: CopyJob) -> CopyJob:
        with self._cond:
            if self._closed:
                raise RuntimeError("snapshot copier is closed")
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="lr-snapshot-copy", daemon=True)
                self._thread.start()
            self._queue.append(job)
            self._cond.notify_all()
        return job

    def then(self, job: CopyJob, callback: Callable[[], None]) -> None:
        """Run ``callback`` once ``job`` has landed: on the copier thread, or here if it already has."""
        with self._cond:
            if not job.sealed:
                job.then.append(callback)
                return
        job.done.wait()  # sealed: its callbacks have run, done is being set
        if job.error is None:
            callback()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.pop(0)
            try:
                copy_pairs(job.pairs)
                if job.event is not None:
                    job.event.synchronize()
            except BaseException as err:  # surfaced by job.wait() on the training thread
                job.error = err
            while True:  # what follows the copy runs before done: whoever waits for the copy finds it done too
                with self._cond:
                    if not job.then:
                        job.sealed = True
                        break
                    then, job.then = job.then, []
                if job.error is None:
                    for callback in then:
                        _run_quietly(callback)
            job.done.set()

    def close(self, timeout: timedelta) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout.total_seconds())


def _run_quietly(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:  # what follows a copy (a marker) is best effort: the snapshot itself is intact
        log.exception("after a snapshot copy: %s failed", callback)


def copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each pair, in one call into torch where the pairs allow it (a per-tensor Python loop
    costs about a microsecond a tensor, a few hundred tensors a step)."""
    if not pairs:
        return
    dsts = [d for d, _ in pairs]
    srcs = [s for _, s in pairs]
    try:
        torch._foreach_copy_(dsts, srcs)
    except (RuntimeError, TypeError):  # mixed devices or layouts: one by one
        for dst, src in pairs:
            dst.copy_(src)
