"""What every cross-rank wait of the suite is bounded by and how it fails: a :class:`Deadline`, and one typed error
(:class:`CollectiveError`, :class:`CollectiveTimeoutError`). The side groups (:mod:`lightning_resilience.collective`)
raise them; callers import them from there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["CollectiveError", "CollectiveTimeoutError", "Deadline", "Failing"]

log = logging.getLogger(__name__)


class CollectiveError(RuntimeError):
    """An agreement across ranks failed: a peer is gone, crashed, or did not answer in time.

    Every rank that took part gets one (a rank whose peers never came gets it at its deadline), so every rank can
    take the same way out: the job stops and the launcher restarts it. The side group is unusable afterwards.

    Attributes:
        op: what was being agreed (``checkpoint.agree``, ``peer.exchange``...).
        group: the side group's name.
    """

    def __init__(self, message: str, *, op: str = "", group: str = "") -> None:
        super().__init__(message)
        self.op, self.group = op, group

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), self.op, self.group))


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A peer did not arrive at an agreement within the deadline (hung, far behind, or on another path)."""


def _rebuild(cls: type[CollectiveError], message: str, op: str, group: str) -> CollectiveError:
    return cls(message, op=op, group=group)


class Deadline:
    """A point in time by which something must be done; ``remaining()`` shrinks, and is never negative.

    Args:
        budget: how long from now; None is unbounded (``remaining()`` is then None).
        clock: monotonic seconds (injectable).
    """

    def __init__(self, budget: timedelta | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._end = None if budget is None else clock() + budget.total_seconds()

    def remaining(self) -> timedelta | None:
        if self._end is None:
            return None
        return timedelta(seconds=max(0.0, self._end - self._clock()))

    @property
    def expired(self) -> bool:
        left = self.remaining()
        return left is not None and left <= timedelta(0)

    def bound(self, limit: timedelta) -> timedelta:
        """The shorter of ``limit`` and what is left."""
        left = self.remaining()
        return limit if left is None else min(limit, left)

    def check(self, what: str) -> None:
        """Raise :class:`TimeoutError` (an ``OSError``: a failed write, not a crash) once the deadline passed."""
        if self.expired:
            raise TimeoutError(f"{what}: deadline passed before it could start")


class Failing:
    """Turns what gloo or a link raises inside it into a :class:`CollectiveError` (:class:`CollectiveTimeoutError` when
    it timed out), hands that to ``broken`` and raises it. A plain context manager: every step's round enters one, and
    a generator-based one cost more CPU than the exchange's Python.

    Args:
        group: the side group's name; rank: this rank in it (both for the message).
        op: what was being agreed.
        timeout: the bound the operation had.
        broken: told of the failure (the group is unusable from then on).
    """

    __slots__ = ("broken", "group", "op", "rank", "start", "timeout")

    def __init__(
        self, group: str, rank: int, op: str, timeout: timedelta, broken: Callable[[CollectiveError], None]
    ) -> None:
        self.group, self.rank, self.op, self.timeout, self.broken = group, rank, op, timeout, broken
        self.start = time.monotonic()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, err: BaseException | None, trace: Any) -> None:
        if isinstance(err, CollectiveError):  # typed already (a reduction carried by the step agreement)
            self.broken(err)
            return
        # gloo: "Operation timed out!", "Connection closed by peer"; the tcp links: TimeoutError, ConnectionError
        if not isinstance(err, (RuntimeError, OSError)):
            return
        text = str(err).lower()
        timed_out = isinstance(err, TimeoutError) or "timed out" in text or "timeout" in text
        what = (
            f"no answer within {self.timeout.total_seconds():g}s"
            if timed_out
            else f"a peer failed after {time.monotonic() - self.start:.1f}s ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]})"
        )
        failure = (CollectiveTimeoutError if timed_out else CollectiveError)(
            f"side group {self.group!r}, rank {self.rank}: {self.op} failed: {what}; a rank is hung, gone or took "
            "another path. The job should stop so the launcher can restart it.",
            op=self.op,
            group=self.group,
        )
        self.broken(failure)
        log.error("%s", failure)
        raise failure from err
