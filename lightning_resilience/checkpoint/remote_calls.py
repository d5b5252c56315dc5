"""Requests to a remote store: each bounded by a timeout (and a write's deadline), transient faults retried with
capped exponential backoff, and what still fails turned into a :class:`RemoteTierError` that names what to fix."""

from __future__ import annotations

import errno
import inspect
import logging
import random
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from fsspec.asyn import AsyncFileSystem, sync

from lightning_resilience.checkpoint.remote_faults import RemoteFault, RemoteTierError, StoreAddress, classify_error
from lightning_resilience.collective import Deadline

__all__ = ["RetryingCalls"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_MIN_TRANSFER_BYTES_PER_S = 1 << 20
"""A transfer slower than this on average is treated as hung (on top of ``timeout_s``)."""


class RetryingCalls:
    """The request machinery of :class:`~lightning_resilience.checkpoint.remote.RemoteTier`."""

    name: str
    fs: Any
    retries: int
    backoff_s: float
    max_backoff_s: float
    timeout_s: float
    retries_total: int
    _sleep: Callable[[float], None]
    _random: random.Random
    _lock: threading.Lock
    _deadline: threading.local
    _address: StoreAddress

    def _current_deadline(self) -> Deadline | None:
        deadline: Deadline | None = getattr(self._deadline, "value", None)
        return deadline

    def _op(self, method: str, *args: Any, nbytes: int = 0, **kwargs: Any) -> Any:
        """Call ``fs.<method>``; on an asynchronous backend, bounded by the tier's timeout and the write's
        deadline (a synchronous backend is checked against the deadline before each call)."""
        fs = self.fs
        coro = getattr(fs, f"_{method}", None)
        timeout = self.timeout_s + nbytes / _MIN_TRANSFER_BYTES_PER_S
        deadline = self._current_deadline()
        if deadline is not None:
            deadline.check(f"tiers.{self.name}: {method}")
            timeout = deadline.bound(timedelta(seconds=timeout)).total_seconds()
        if isinstance(fs, AsyncFileSystem) and inspect.iscoroutinefunction(coro):
            return sync(fs.loop, coro, *args, timeout=timeout, **kwargs)
        return getattr(fs, method)(*args, **kwargs)

    def _call(self, what: str, fn: Callable[[], T], attempts: int | None = None) -> T:
        """Run ``fn``, retrying transient faults with backoff.

        Raises:
            FileNotFoundError: the object is missing (the caller knows what that means).
            RemoteTierError: any other store fault, after the retries for a transient one.
        """
        attempts = self.retries + 1 if attempts is None else max(1, attempts)
        for attempt in range(attempts):
            try:
                return fn()
            except Exception as err:
                fault = classify_error(err)
                if fault is RemoteFault.BUG:
                    raise
                if fault is RemoteFault.NOT_FOUND:
                    if isinstance(err, FileNotFoundError):
                        raise
                    raise FileNotFoundError(errno.ENOENT, f"{what}: not found ({err})") from err
                if fault is not RemoteFault.TRANSIENT or attempt + 1 == attempts:
                    raise self._error(what, err, fault, attempt + 1) from err
                delay = self._backoff(attempt)
                deadline = self._current_deadline()
                if deadline is not None and deadline.bound(timedelta(seconds=delay)) < timedelta(seconds=delay):
                    raise self._error(what, err, fault, attempt + 1) from err  # no time left to wait and retry
                with self._lock:
                    self.retries_total += 1
                log.warning(
                    "tiers.%s: %s failed (%s: %s); retry %d of %d in %.2fs",
                    self.name,
                    what,
                    type(err).__name__,
                    err,
                    attempt + 1,
                    attempts - 1,
                    delay,
                )
                self._sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _backoff(self, attempt: int) -> float:
        ceiling = min(self.max_backoff_s, self.backoff_s * (2**attempt))
        return ceiling * self._random.uniform(0.5, 1.0)

    @property
    def endpoint(self) -> str:
        """Who answers for this URL, for error messages."""
        return self._address.endpoint

    def _error(self, what: str, err: BaseException, fault: RemoteFault, attempts: int) -> RemoteTierError:
        return self._address.error(what, err, fault, attempts)
