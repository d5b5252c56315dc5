"""The agreement of a step: a small vector of integers reduced over every rank along a tree, off the training thread.

Everything the ranks must agree on at a step boundary (the policy's action, a preemption notice, SDC's late guard
flags, the checkpoint engine's persist view) is a field of one int64 vector, each field with its own reduction
(:class:`Op`). :meth:`TreeAgreement.reduce` hands the vector to a thread of its own and returns at once; the caller
takes the result later (:meth:`Pending.result`, normally at the next step boundary, when it has long arrived).

The thread reduces along a ``fanout``-ary tree of the ranks (rank ``r``'s parent is ``(r - 1) // fanout``): it
receives its children's partial vectors, combines them with its own, sends the result to its parent, receives the
agreed vector from it and passes it down. A round is ``2 * depth`` hops (depth ``ceil(log_fanout N)``), each rank
talks to at most ``fanout + 1`` peers, and with a lazily connected gloo group (:mod:`lightning_resilience.collective`)
it opens no other socket: the cost per rank does not grow with the number of ranks, the latency grows with its
logarithm. :meth:`TreeAgreement.gather` sends one payload per rank up the same tree to rank 0 (the straggler
exchange: records to one rank, never N records to every rank). Nothing on the way parses them: a rank sends up its own
framed record followed by its children's blobs as they came, and rank 0 gets those blobs (:class:`Gathered`), so
no rank's process does per-record work that grows with N; whoever reads them calls :meth:`Gathered.records` (rank 0's
straggler scorer, in a process of its own).

Every exchange goes through :meth:`SideGroup.exchange`: bounded by the group's timeout, typed errors, the fault hook.
A failed round fails every later one at once, and the caller gets the error when it takes the result.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from functools import lru_cache, partial
from typing import Any

import numpy as np

from lightning_resilience.collective import CollectiveTimeoutError, Deadline, SideGroup
from lightning_resilience.links import Blob
from lightning_resilience.rank_tree import FANOUT, RankTree

__all__ = ["AgreementStats", "Gathered", "Op", "Pending", "TreeAgreement", "combine", "frame", "unframe"]

log = logging.getLogger(__name__)


class Op(str, Enum):
    """How one field of the vector is reduced over the ranks."""

    MAX = "max"
    MIN = "min"
    AND = "and"
    """Bitwise AND: a flag that must hold on every rank, or a set of steps every rank holds."""
    OR = "or"
    """Bitwise OR: a flag raised on some rank."""
    SUM = "sum"


_COMBINE: dict[Op, Callable[[int, int], int]] = {
    Op.MAX: max,
    Op.MIN: min,
    Op.AND: lambda a, b: a & b,
    Op.OR: lambda a, b: a | b,
    Op.SUM: lambda a, b: a + b,
}


def combine(ops: Sequence[Op], a: Sequence[int], b: Sequence[int]) -> list[int]:
    """Field by field, the reduction of two partial vectors."""
    return [_COMBINE[op](x, y) for op, x, y in zip(ops, a, b)]


@lru_cache(maxsize=8)
def _vector(fields: int) -> struct.Struct:
    """The wire format of a vector of ``fields`` int64 values."""
    return struct.Struct(f"<{fields}q")


_RECORD = struct.Struct("<iI")  # a framed record's head: the rank, the body's length


def frame(records: Sequence[tuple[int, bytes]]) -> bytes:
    """``(rank, body)`` records as one blob; blobs concatenate into a blob of all their records."""
    return b"".join(_RECORD.pack(rank, len(body)) + body for rank, body in records)


def unframe(blobs: Sequence[Blob]) -> list[tuple[int, bytes]]:
    """Every ``(rank, body)`` record of ``blobs`` (made by :func:`frame`, or concatenations of them), in rank order.

    Raises:
        ValueError: a blob is cut short (a record's length runs past its end).
    """
    out: list[tuple[int, bytes]] = []
    for data in blobs:
        at, end = 0, len(data)
        while at < end:
            if at + _RECORD.size > end:
                raise ValueError(f"a gathered blob ends inside a record's head ({end - at} bytes left)")
            rank, size = _RECORD.unpack_from(data, at)
            at += _RECORD.size
            if at + size > end:
                raise ValueError(f"rank {rank}'s gathered record is cut short ({end - at} of {size} bytes)")
            out.append((rank, bytes(data[at : at + size])))
            at += size
    out.sort(key=lambda record: record[0])
    return out


def unframe_uniform(blob: Blob) -> tuple[np.ndarray, np.ndarray] | None:
    """The records of one blob whose records all have the same length, without a Python object per record: their
    ranks and their bodies (records x length bytes, views on ``blob``); None when the lengths differ (read it with
    :func:`unframe`)."""
    if len(blob) < _RECORD.size:
        return None
    _, size = _RECORD.unpack_from(blob, 0)
    width = _RECORD.size + size
    if len(blob) % width:
        return None
    rows = np.frombuffer(blob, dtype=np.uint8).reshape(-1, width)
    heads = np.ascontiguousarray(rows[:, : _RECORD.size]).view("<u4")  # rank (as written, two's complement), size
    if not bool((heads[:, 1] == size).all()):
        return None
    return heads[:, 0].view("<i4").astype(np.int64), rows[:, _RECORD.size :]


@dataclass(frozen=True)
class Gathered:
    """What a gather brought to rank 0, as it arrived: rank 0's own framed record and one blob per child holding the
    records of its whole subtree, none of them parsed (empty on the other ranks). :meth:`records` reads them."""

    blobs: tuple[Blob, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.blobs)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blobs)

    def records(self) -> list[tuple[int, bytes]]:
        """Every rank's ``(rank, payload)``, in rank order: work that grows with N, for whoever reads them."""
        return unframe(self.blobs)


@dataclass
class AgreementStats:
    """What the agreements cost: rounds, their latency on the agreement thread, and the training thread's waits."""

    rounds: int = 0
    gathers: int = 0
    round_seconds: float = 0.0
    """Issue to completion, summed over rounds (on the agreement thread: the training thread does not wait it)."""
    round_seconds_max: float = 0.0
    waited_seconds: float = 0.0
    """Time the training thread spent waiting for a result that had not arrived yet."""
    waits: int = 0
    """Results taken before they had arrived (the training thread waited)."""
    side_reductions: int = 0
    """Side groups' reductions carried (:meth:`TreeAgreement.reduce_now`), waited for at the steps that need them."""
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    """Latency of the most recent rounds (at most 1,000), for benchmarks."""


class Pending:
    """The result of one round, taken later on the caller's thread.

    Args:
        timeout: bound on the round (default: the group's).
        side: a side group's reduction (:meth:`TreeAgreement.reduce_now`), not a step's round: not in the rounds'
            statistics.
    """

    def __init__(
        self, owner: TreeAgreement, op: str, step: int | None, timeout: timedelta | None = None, *, side: bool = False
    ) -> None:
        self.op, self.step, self.side = op, step, side
        self.timeout = timeout or owner.timeout
        self._owner = owner
        self._waiting = threading.Lock()  # held until the result arrives (a lock costs less than an Event a step)
        self._waiting.acquire()
        self._value: Any = None
        self._error: BaseException | None = None
        self.issued = time.perf_counter()

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._waiting.release()

    def done(self) -> bool:
        """Whether the result has arrived (taking it will not wait)."""
        return not self._waiting.locked()

    def result(self, timeout: timedelta | None = None) -> Any:
        """The agreed vector (a gather: a :class:`Gathered`, empty but on rank 0).

        Waits at most ``timeout`` (default: the group's); raises what the round raised, or
        :class:`CollectiveTimeoutError` when it has not finished in time (the agreement is broken from then on)."""
        if self._waiting.locked():
            start = time.perf_counter()
            limit = timeout or self.timeout
            arrived = self._waiting.acquire(timeout=limit.total_seconds())
            if arrived:
                self._waiting.release()  # taken again later: it answers at once
            stats = self._owner.stats
            if not self.side:  # a side group's reduction is waited for by design, at a step a cadence names
                stats.waits += 1
                stats.waited_seconds += time.perf_counter() - start
            if not arrived:
                error = CollectiveTimeoutError(
                    f"agreement {self._owner.name!r}: {self.op} of step {self.step} not agreed within "
                    f"{limit.total_seconds():g}s; a rank is hung, gone or far behind",
                    op=self.op,
                    group=self._owner.name,
                )
                self._owner.fail(error)
                raise error
        if self._error is not None:
            raise self._error
        return self._value


_STOP = object()


class TreeAgreement:
    """Reductions and gathers of small payloads along a tree of the ranks, run by a thread of its own.

    Args:
        group: a side group used by this object alone (its thread is the only caller); its timeout bounds every
            exchange. Without peers (one rank, no process group) every round completes at once on the caller's thread.
        fanout: children per rank in the tree.
        timeout: bound on a round and a gather (default and at most: the group's); a side group's reduction
            (:meth:`reduce_now`) brings its own, up to the group's.
    """

    def __init__(self, group: SideGroup, *, fanout: int = FANOUT, timeout: timedelta | None = None) -> None:
        if fanout < 2:
            raise ValueError(f"agreement fanout must be >= 2, got {fanout}")
        self.group, self.fanout = group, fanout
        self.name = group.name
        self.timeout = min(timeout or group.timeout, group.timeout)
        self.stats = AgreementStats()
        self.tree = RankTree(group.rank, group.world_size, fanout)
        self.parent, self.children = self.tree.parent, self.tree.children
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._sent: list[Any] = []
        self._lock = threading.Lock()

    @property
    def depth(self) -> int:
        """Levels of the tree below rank 0 (a round is twice as many hops)."""
        return self.tree.depth

    def thread_cpu_seconds(self) -> float | None:
        """CPU time of the agreement's thread so far (None before its first round, or where the platform has no
        per-thread CPU clock)."""
        thread = self._thread
        if thread is None or thread.ident is None or not hasattr(time, "pthread_getcpuclockid"):
            return None
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except OSError:  # the thread has ended
            return None

    def fail(self, error: BaseException) -> None:
        """Every later round fails with ``error`` (a round timed out or a peer failed)."""
        with self._lock:
            self._failed = self._failed or error

    # ------------------------------------------------------------------ requests
    def reduce(self, values: Sequence[int], ops: Sequence[Op], *, op: str, step: int | None = None) -> Pending:
        """Issue the reduction of ``values`` (one per field, reduced by ``ops``); returns at once."""
        if len(values) != len(ops):
            raise ValueError(f"agreement {op}: {len(values)} values for {len(ops)} fields")
        return self._submit(("reduce", [int(v) for v in values], list(ops)), Pending(self, op, step))

    def gather(self, payload: bytes, *, op: str, step: int | None = None) -> Pending:
        """Issue the gather of one payload per rank to rank 0; returns at once."""
        return self._submit(("gather", bytes(payload), None), Pending(self, op, step))

    def reduce_now(self, values: list[int], how: str, op: str, step: int | None, timeout: timedelta) -> list[int]:
        """A side group's reduction (a :data:`~lightning_resilience.collective.Reducer`: ``how`` is 'max', 'min' or
        'and', elementwise), waited for, within ``timeout``: along this tree, on its thread and links, so the
        training thread's reductions at the steps a cadence names open no socket of their own. It goes after the
        rounds and gathers already issued: every rank reaches it at the same point of its work (the side groups'
        rule), so the queues agree."""
        pending = Pending(self, f"side.{op}", step, timeout, side=True)
        return list(self._submit(("reduce", [int(v) for v in values], [Op(how)] * len(values)), pending).result())

    def _submit(self, request: tuple[str, Any, Any], pending: Pending) -> Pending:
        if not self.group.distributed:
            kind, body, _ = request
            pending._set(Gathered((frame([(0, body)]),)) if kind == "gather" else list(body))
            return pending
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"lr-agreement-{self.name}", daemon=True)
                self._thread.start()
        self._queue.put((request, pending))
        return pending

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> bool:
        """Stop the thread after the rounds already issued, once the last round's sends are delivered (a slower
        peer still has to receive its agreed vector: dropped with the group, it would wait for it until its own
        deadline); bounded by ``timeout`` (and a second for the thread to end). True when the thread has ended."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return True
        self._queue.put((_STOP, Deadline(timeout)))
        thread.join(timeout.total_seconds() + 1.0)
        if thread.is_alive():
            log.warning("agreement %r: its thread did not end within %s (a round is still waiting)", self.name, timeout)
        return not thread.is_alive()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item[0] is _STOP:
                self._deliver(item[1])
                return
            (kind, body, ops), pending = item
            with self._lock:
                failed = self._failed
            if failed is not None:
                pending._set(error=failed)
                continue
            try:
                if kind == "reduce":
                    value: Any = self._reduce(body, ops, pending)
                else:
                    value = self._gather(body, pending)
            except BaseException as err:
                self.fail(err)
                pending._set(error=err)
                continue
            latency = time.perf_counter() - pending.issued
            stats = self.stats
            if pending.side:
                stats.side_reductions += 1
                pending._set(value)
                continue
            stats.rounds += kind == "reduce"
            stats.gathers += kind == "gather"
            stats.round_seconds += latency
            stats.round_seconds_max = max(stats.round_seconds_max, latency)
            stats.latencies.append(latency)
            pending._set(value)

    def _exchange(
        self, payload: bytes | None, send_to: list[int], recv_from: list[int], pending: Pending, deadline: Deadline
    ) -> list[bytes | None]:
        return self.group.exchange(
            payload, send_to=send_to, recv_from=recv_from, op=pending.op, step=pending.step, deadline=deadline
        )

    def _reduce(self, values: list[int], ops: list[Op], pending: Pending) -> list[int]:
        """Fixed-size messages, so a leaf (most ranks) waits once per round: send up and receive down together.
        The vector travels as packed int64 (no tensor: on this thread, beside a computing step, a tensor per
        message cost more CPU than the exchange itself)."""
        deadline = Deadline(pending.timeout)
        if self._sent:
            self._settle_sends(deadline)
        fmt = _vector(len(values))
        swap = partial(self.group.swap, op=pending.op, step=pending.step, deadline=deadline)
        if self.children:
            parts, _ = swap([], [(c, fmt.size) for c in self.children])
            for part in parts:
                values = combine(ops, values, fmt.unpack(part))
        mine = fmt.pack(*values)
        if self.parent is not None:
            (mine,), sent = swap([(self.parent, mine)], [(self.parent, fmt.size)])
            self._sent += sent
        if self.children:
            self._sent += swap([(c, mine) for c in self.children], [])[1]
        return list(fmt.unpack(mine))

    def _settle_sends(self, deadline: Deadline) -> None:
        """The previous round's sends, before this round's: delivered long ago (their peers answered since)."""
        sent, self._sent = self._sent, []
        for work in sent:
            if not work.is_completed():
                work.wait(deadline.bound(self.timeout))

    def _deliver(self, deadline: Deadline) -> None:
        """At close: the last round's sends, delivered before the group may go (a peer gone or hung: logged)."""
        with self._lock:
            failed = self._failed
        if failed is not None:
            return
        try:
            self._settle_sends(deadline)
        except Exception as err:  # the peer's own round fails or times out: it says so
            log.warning("agreement %r: the last round's answer did not reach a peer at close (%s)", self.name, err)

    def _gather(self, payload: bytes, pending: Pending) -> Gathered:
        """Up the tree without parsing: this rank's framed record, then its children's blobs as they came (one
        concatenation on the way up; rank 0 keeps them apart, large ones in shared memory, as received)."""
        deadline = Deadline(pending.timeout)
        blobs: list[Blob] = [frame([(self.group.rank, payload)])]
        if self.children:
            got = self.group.receive(self.children, op=pending.op, step=pending.step, deadline=deadline)
            blobs += [part for part in got if part]
        if self.parent is not None:
            self._exchange(b"".join(blobs), [self.parent], [], pending, deadline)
            return Gathered()
        return Gathered(tuple(blobs))
