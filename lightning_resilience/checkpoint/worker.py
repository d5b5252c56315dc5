"""The owned background worker that moves snapshots to slower tiers.

One thread, one job at a time. The owner polls it on the training thread: results come back there, an error that
escaped a job is re-raised there, and a worker that died is noticed there instead of being waited on forever.
Every wait is bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning_resilience.checkpoint.errors import CheckpointWorkerError

__all__ = ["PersistWorker"]


class PersistWorker:
    """A single background thread that runs persist jobs one at a time.

    Args:
        name: thread name (shows up in stack dumps).
    """

    def __init__(self, name: str = "lr-persist") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._job: Callable[[], Any] | None = None
        self._running = False
        self._results: list[Any] = []
        self._error: BaseException | None = None
        self._died: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._job is not None or self._running

    def _ensure_started(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()

    def _check_alive(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointWorkerError(f"checkpoint persist worker failed: {type(err).__name__}: {err}") from err
        thread_gone = self._thread is not None and not self._thread.is_alive() and not self._closing
        if self._died is not None or thread_gone:
            raise CheckpointWorkerError(
                "checkpoint persist worker died without reporting an error; the last in-flight persist is lost, "
                "earlier committed checkpoints are intact"
            ) from self._died

    def submit(self, job: Callable[[], Any]) -> None:
        """Start ``job`` in the background.

        Raises:
            RuntimeError: the worker is busy (callers check :attr:`busy` first) or closed.
            CheckpointWorkerError: an earlier job failed or the worker died.
        """
        with self._cond:
            self._check_alive()
            if self._closing:
                raise RuntimeError("persist worker is closed")
            if self._job is not None or self._running:
                raise RuntimeError("persist worker is busy; check .busy before submitting")
            self._ensure_started()
            self._job = job
            self._cond.notify_all()

    def poll(self) -> list[Any]:
        """Results of jobs finished since the last poll; re-raises a job's escaped error on the caller."""
        with self._cond:
            self._check_alive()
            results, self._results = self._results, []
            return results

    def wait_idle(self, timeout: timedelta) -> bool:
        """Wait until no job is queued or running. Returns False on timeout; raises if the worker died."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._cond:
            while self._job is not None or self._running:
                self._check_alive()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # wake up periodically: a thread that dies does not notify
                self._cond.wait(min(remaining, 0.5))
            self._check_alive()
            return True

    def close(self, timeout: timedelta) -> bool:
        """Finish the job in flight (bounded), then stop the thread. Returns False if it did not stop in time."""
        idle = True
        try:
            idle = self.wait_idle(timeout)
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join(timeout=max(0.0, timeout.total_seconds()) if idle else 0.1)
        return idle and (self._thread is None or not self._thread.is_alive())

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closing:
                    self._cond.wait()
                if self._job is None:
                    return
                job, self._job = self._job, None
                self._running = True
            try:
                result = job()
            except Exception as err:  # latched, re-raised on the training thread by poll()
                with self._cond:
                    self._error = err
                    self._running = False
                    self._cond.notify_all()
                continue
            except BaseException as err:
                with self._cond:
                    self._died = err  # noticed by the owner even before the thread is gone
                    self._running = False
                    self._cond.notify_all()
                raise
            with self._cond:
                self._results.append(result)
                self._running = False
                self._cond.notify_all()
