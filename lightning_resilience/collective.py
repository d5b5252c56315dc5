"""The one place for cross-rank agreements: a side gloo group, an explicit deadline on every wait, one typed error.

Every component that agrees on something across ranks (the checkpoint engine's persist and restore decisions, the
peer-tier exchange, the policy, SDC and straggler exchanges) does it through a :class:`SideGroup`:

* a **side gloo group** of its own, created at setup in the same order on every rank, so small agreements never
  interleave with the training collectives (NCCL or gloo) and run on the host;
* an **explicit timeout** from the component's config (never the process-group default of 30 minutes), and a
  per-call ``deadline`` that can only shorten it (an emergency save passes what is left of its budget);
* one **typed error**: a peer that is gone, crashed or late turns into :class:`CollectiveError`
  (:class:`CollectiveTimeoutError` when the deadline passed) on every rank that takes part, within the deadline.
  After a failure the group is *broken*: every later call raises at once instead of waiting on a pair that gloo has
  closed.

The rule that makes this enough is the caller's: a call site is reached by all ranks on all paths, or by none. A
rank-local path (a save after an exception, when other ranks may be dead) never calls the group. Errors found on
one rank before an agreement are carried *into* it (``all_true(ok)``) rather than raised before it, so every rank
takes the same branch afterwards (torchft's ``should_commit`` pattern).

Tests and drills inject faults with :func:`set_fault_hook` (see :mod:`lightning_resilience.testing.faults`).
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_resilience._plain_pickle import loads_plain
from lightning_resilience.deadline import CollectiveError, CollectiveTimeoutError, Deadline, Failing
from lightning_resilience.links import Blob, TcpLinks

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "Deadline",
    "FaultHook",
    "Reducer",
    "SideGroup",
    "set_fault_hook",
]

Reducer = Callable[[list[int], str, str, "int | None", timedelta], list[int]]
"""``reducer(values, how, op, step, timeout)``: every rank's ``values`` reduced elementwise (``how``: 'max', 'min',
'and'), on every rank, within ``timeout`` (:meth:`SideGroup.reduce_through`)."""

FaultHook = Callable[[str, int, "int | None"], None]
"""``hook(op, rank, step)``: called before every operation of every side group; may raise, block or exit."""

_fault_hook: FaultHook | None = None
_hook_lock = threading.Lock()


def set_fault_hook(hook: FaultHook | None) -> FaultHook | None:
    """Install (or with None remove) the process-wide fault hook of the side groups; returns the previous one.

    For tests and drills only (:class:`lightning_resilience.testing.faults.FaultPlan` installs it); nothing in the
    library sets it.
    """
    global _fault_hook
    with _hook_lock:
        previous, _fault_hook = _fault_hook, hook
    return previous


class SideGroup:
    """A gloo group for small host-side agreements, with a timeout on every wait (or, with ``transport="tcp"``,
    direct TCP links for point-to-point exchanges: :mod:`lightning_resilience.links`).

    Creating one is collective when ``torch.distributed`` is initialised with several ranks: every rank of the
    default group constructs it, in the same order. Without a process group, or with one rank, every operation is
    the local identity and nothing waits.

    Args:
        name: label in errors and logs (``checkpoint``, ``peer``, ``policy``...).
        timeout: bound on every wait (the gloo group's own timeout too).
        parent: the ranks to span (a process group); default all ranks.
        local: a group of this rank alone, whatever the process group (not collective: e.g. a component not yet
            set up).
        transport: ``gloo``, or ``tcp``: :meth:`exchange` and :meth:`swap` over links of its own (the step
            agreement's: a small message costs a few times less CPU there than through gloo's point-to-point); a
            tcp group has no collectives.
    """

    def __init__(
        self, name: str, timeout: timedelta, parent: Any = None, *, local: bool = False, transport: str = "gloo"
    ) -> None:
        if timeout <= timedelta(0):
            raise ValueError(f"{name}: collective timeout must be > 0, got {timeout}")
        if transport not in _TRANSPORTS:
            raise ValueError(f"{name}: transport must be one of {sorted(_TRANSPORTS)}, got {transport!r}")
        if transport == "tcp" and parent is not None:
            raise ValueError(f"{name}: a tcp side group spans every rank (no parent group)")
        self.name = name
        self.timeout = timeout
        self.transport = transport
        self.rank, self.world_size = 0, 1
        self._link = _Link()
        if not local and dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(parent), dist.get_world_size(parent)
            if self.world_size > 1 and transport == "tcp":
                self._link.tcp = _new_links(name, self.rank)
            elif self.world_size > 1:
                ranks = dist.get_process_group_ranks(parent) if parent is not None else None
                self._link.group = _new_lazy_group(ranks, timeout)

    def view(self, name: str, timeout: timedelta) -> SideGroup:
        """The same gloo group under another name and timeout (not collective): components that agree on the same
        thread share one group; a failure seen through any view breaks them all (the group underneath is unusable)."""
        other = SideGroup(name, timeout, local=True, transport=self.transport)
        other.rank, other.world_size, other._link = self.rank, self.world_size, self._link
        return other

    _group = property(lambda self: self._link.group)

    @property
    def _broken(self) -> CollectiveError | None:
        return self._link.broken

    def _fail(self, error: CollectiveError) -> None:
        """The group is unusable from now on, for every view of it."""
        self._link.broken = error

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_link": _Link()}  # a process group belongs to the process that made it

    def __repr__(self) -> str:
        return f"SideGroup({self.name!r}, rank={self.rank}, world_size={self.world_size}, timeout={self.timeout})"

    @property
    def distributed(self) -> bool:
        """True when there are peers to agree with."""
        return self._group is not None or self._link.tcp is not None

    def close(self) -> None:
        """Close a tcp group's links (what was sent is still delivered; every later call fails). A gloo group goes
        with the default process group."""
        if self._link.tcp is not None:
            self._link.tcp.close()

    broken = property(lambda self: self._broken is not None, doc="True once an agreement failed: later calls raise.")

    def global_rank(self, rank: int) -> int:
        """The default-group rank of group rank ``rank`` (for point-to-point transfers)."""
        return rank if self._group is None else dist.get_global_rank(self._group, rank)

    # ------------------------------------------------------------------ agreements
    def all_gather_object(
        self,
        obj: Any,
        *,
        op: str,
        step: int | None = None,
        deadline: Deadline | None = None,
        any_type: bool = False,
    ) -> list[Any]:
        """Every rank's ``obj``, in rank order: built-in values and containers, and dataclasses and enums of this
        package (nothing else is unpickled; tensors go through :meth:`all_gather_tensor`). ``any_type``: any
        picklable object, tensors included (a training batch of the user's own types and RNG states, which the
        ranks of one job exchange to replay each other's steps), through ``torch.distributed.all_gather_object``;
        its wait is bounded by the group's timeout, which a ``deadline`` cannot shorten (none may be given)."""
        if any_type and deadline is not None:
            raise ValueError(f"side group {self.name!r}: {op}: an any_type gather takes no deadline")
        if not self._enter(op, step):
            return [obj]
        timeout = self._bound(op, deadline)
        if any_type:
            gathered: list[Any] = [None] * self.world_size
            with Failing(self.name, self.rank, op, timeout, self._fail):
                dist.all_gather_object(gathered, obj, group=self._group)
            return gathered
        data = pickle.dumps(obj)
        with Failing(self.name, self.rank, op, timeout, self._fail):
            size = torch.tensor([len(data)], dtype=torch.int64)
            sizes = [torch.empty_like(size) for _ in range(self.world_size)]
            dist.all_gather(sizes, size, group=self._group, async_op=True).wait(timeout)
            longest = max(int(s.item()) for s in sizes)
            buf = torch.zeros(longest, dtype=torch.uint8)
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(parts, buf, group=self._group, async_op=True).wait(timeout)
        return [loads_plain(p[: int(n.item())].numpy().tobytes()) for p, n in zip(parts, sizes)]

    def all_gather_tensor(
        self, tensor: torch.Tensor, *, op: str, step: int | None = None, deadline: Deadline | None = None
    ) -> list[torch.Tensor]:
        """Every rank's CPU ``tensor`` (same shape and dtype on every rank), in rank order."""
        if not self._enter(op, step):
            return [tensor]
        timeout = self._bound(op, deadline)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with Failing(self.name, self.rank, op, timeout, self._fail):
            dist.all_gather(parts, tensor, group=self._group, async_op=True).wait(timeout)
        return parts

    def all_true(self, flag: bool, *, op: str, step: int | None = None, deadline: Deadline | None = None) -> bool:
        """True if ``flag`` is true on every rank."""
        return bool(self._reduce(int(bool(flag)), "min", op, step, deadline))

    def any_true(self, flag: bool, *, op: str, step: int | None = None, deadline: Deadline | None = None) -> bool:
        """True if ``flag`` is true on some rank."""
        return bool(self._reduce(int(bool(flag)), "max", op, step, deadline))

    def reduce_max(self, value: int, *, op: str, step: int | None = None, deadline: Deadline | None = None) -> int:
        """The largest ``value`` of all ranks."""
        return int(self._reduce(int(value), "max", op, step, deadline))

    def reduce_min(self, value: int, *, op: str, step: int | None = None, deadline: Deadline | None = None) -> int:
        """The smallest ``value`` of all ranks."""
        return int(self._reduce(int(value), "min", op, step, deadline))

    def reduce_and_each(
        self, values: Sequence[int], *, op: str, step: int | None = None, deadline: Deadline | None = None
    ) -> list[int]:
        """The bitwise AND of all ranks' ``values[i]`` for each ``i`` (same length on every rank), in one
        all-reduce: a flag that must hold everywhere, or a bit set of steps every rank holds."""
        return self._reduce_all(list(values), "and", op, step, deadline)

    def reduce_max_each(
        self, values: Sequence[int], *, op: str, step: int | None = None, deadline: Deadline | None = None
    ) -> list[int]:
        """The largest of all ranks' ``values[i]`` for each ``i`` (same length on every rank), in one all-reduce."""
        return self._reduce_all(list(values), "max", op, step, deadline)

    def reduce_through(self, reducer: Reducer | None) -> None:
        """Send the reductions of this group and of its views through ``reducer`` (the suite's: along the step
        agreement's tree, on its thread and links, ``2 * log4(N)`` hops and no socket of their own); None: gloo's
        all-reduce on this group (a ring: ``2 * (N - 1)`` hops one after another)."""
        self._link.reducer = reducer

    def _reduce(self, value: int, how: str, op: str, step: int | None, deadline: Deadline | None) -> int:
        return self._reduce_all([int(value)], how, op, step, deadline)[0]

    def _reduce_all(
        self, values: list[int], how: str, op: str, step: int | None, deadline: Deadline | None
    ) -> list[int]:
        if not self._enter(op, step):
            return values
        timeout = self._bound(op, deadline)
        with Failing(self.name, self.rank, op, timeout, self._fail):
            if self._link.reducer is not None:
                return self._link.reducer(values, how, op, step, timeout)
            t = torch.tensor(values, dtype=torch.int64)
            dist.all_reduce(t, op=_REDUCE_OPS[how], group=self._group, async_op=True).wait(timeout)
        return [int(v) for v in t.tolist()]

    # ------------------------------------------------------------------ point to point
    def exchange(
        self,
        payload: bytes | None,
        *,
        send_to: Sequence[int],
        recv_from: Sequence[int],
        op: str,
        step: int | None = None,
        deadline: Deadline | None = None,
    ) -> list[bytes | None]:
        """Send ``payload`` (None: "I have nothing", still sent) to each rank of ``send_to`` while receiving one
        payload from each rank of ``recv_from``; returns what came, in ``recv_from`` order.

        Both sides of every pair must call it with matching lists (``send_to`` of one is ``recv_from`` of the other).
        Ranks are group ranks.
        """
        if not self._enter(op, step, p2p=True):
            return [None for _ in recv_from]
        timeout = self._bound(op, deadline)
        out: list[bytes | None] = []
        if self._link.tcp is not None:
            with Failing(self.name, self.rank, op, timeout, self._fail):
                return self._link.tcp.exchange(payload, send_to, recv_from, time.monotonic() + timeout.total_seconds())
        with Failing(self.name, self.rank, op, timeout, self._fail):
            header = torch.tensor([-1 if payload is None else len(payload)], dtype=torch.int64)
            body = None if not payload else torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            pending = []
            for dst in send_to:
                pending.append(dist.isend(header, self.global_rank(dst), group=self._group))
                if body is not None:
                    pending.append(dist.isend(body, self.global_rank(dst), group=self._group))
            for src in recv_from:
                size = torch.empty(1, dtype=torch.int64)
                _wait(dist.irecv(size, self.global_rank(src), group=self._group), timeout)
                n = int(size.item())
                if n < 0:
                    out.append(None)
                    continue
                buf = torch.empty(n, dtype=torch.uint8)
                if n:
                    _wait(dist.irecv(buf, self.global_rank(src), group=self._group), timeout)
                out.append(buf.numpy().tobytes())
            for work in pending:
                _wait(work, timeout)
        return out

    def receive(
        self, recv_from: Sequence[int], *, op: str, step: int | None = None, deadline: Deadline | None = None
    ) -> list[Blob | None]:
        """:meth:`exchange` that only receives; over a tcp group a large payload lands in a
        :class:`~lightning_resilience.links.SharedBuffer` (another process can map it), over gloo it is bytes."""
        links = self._link.tcp
        if links is None:
            return list(self.exchange(None, send_to=[], recv_from=recv_from, op=op, step=step, deadline=deadline))
        if not self._enter(op, step, p2p=True):
            return [None for _ in recv_from]
        timeout = self._bound(op, deadline)
        with Failing(self.name, self.rank, op, timeout, self._fail):
            return links.receive(recv_from, time.monotonic() + timeout.total_seconds())

    def swap(
        self,
        sends: Sequence[tuple[int, bytes]],
        recvs: Sequence[tuple[int, int]],
        *,
        op: str,
        step: int | None = None,
        deadline: Deadline | None = None,
    ) -> tuple[list[bytes], list[Any]]:
        """Point to point of messages whose sizes both sides know: send each ``(peer, data)``, then receive
        ``(peer, size)`` bytes from each (group ranks). Returns what came, in the order of ``recvs``, and the sends
        still in flight (wait them before the group goes; none over a tcp group, whose sends are delivered to the
        kernel on return). One wait per receive, none per send: the fewest round trips for a thread that shares the
        interpreter; over a tcp group no tensor is made (on a thread beside a computing step, wrapping a message in
        a tensor cost more CPU than sending it)."""
        if not self._enter(op, step, p2p=True):
            return [], []
        timeout = self._bound(op, deadline)
        links = self._link.tcp
        if links is not None:
            with Failing(self.name, self.rank, op, timeout, self._fail):
                return links.swap(sends, recvs, time.monotonic() + timeout.total_seconds()), []
        with Failing(self.name, self.rank, op, timeout, self._fail):
            sent = [dist.isend(_as_tensor(data), self.global_rank(r), group=self._group) for r, data in sends]
            bufs = [torch.empty(n, dtype=torch.uint8) for _, n in recvs]
            for work in [dist.irecv(b, self.global_rank(r), group=self._group) for (r, _), b in zip(recvs, bufs)]:
                _wait(work, timeout)
        return [b.numpy().tobytes() for b in bufs], sent

    # ------------------------------------------------------------------ internals
    def _enter(self, op: str, step: int | None, *, p2p: bool = False) -> bool:
        """Run the fault hook; False when there is nobody to agree with (the caller returns the local answer).
        ``p2p``: a point-to-point exchange, the only kind a tcp group carries."""
        if self._link.tcp is not None and not p2p:
            raise ValueError(f"side group {self.name!r}: a tcp group carries point-to-point exchanges only, not {op}")
        hook = _fault_hook
        if hook is not None:
            try:
                hook(op, self.rank, step)
            except CollectiveError as err:
                self._fail(err)
                raise
        if self._broken is not None:
            raise CollectiveError(
                f"side group {self.name!r}: {op} not attempted, an earlier agreement failed ({self._broken})",
                op=op,
                group=self.name,
            ) from self._broken
        return self._group is not None or (p2p and self._link.tcp is not None)

    def _bound(self, op: str, deadline: Deadline | None) -> timedelta:
        timeout = self.timeout if deadline is None else deadline.bound(self.timeout)
        if timeout <= timedelta(0):
            err = CollectiveTimeoutError(
                f"side group {self.name!r}: no time left for {op} (deadline passed before it started)",
                op=op,
                group=self.name,
            )
            self._fail(err)  # the peers are waiting in it: they will time out, and so must we from now on
            raise err
        return timeout


class _Link:
    """The gloo group (or the tcp links) of a side group and its health, shared by its views."""

    __slots__ = ("broken", "group", "reducer", "tcp")

    def __init__(self) -> None:
        self.group: Any = None
        self.tcp: TcpLinks | None = None
        self.broken: CollectiveError | None = None
        self.reducer: Reducer | None = None


_REDUCE_OPS = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "and": dist.ReduceOp.BAND}
_LAZY = "TORCH_GLOO_LAZY_INIT"
_TRANSPORTS = {"gloo", "tcp"}
_tcp_groups: dict[str, int] = {}


def _new_links(name: str, rank: int) -> TcpLinks:
    """This rank's links of a new tcp side group: its address in the default group's store, under a key of this
    group (side groups are made in the same order on every rank, so the count is the same everywhere)."""
    count = _tcp_groups[name] = _tcp_groups.get(name, -1) + 1
    store = dist.distributed_c10d._get_default_store()
    return TcpLinks(store, f"lightning_resilience/links/{name}/{count}", rank)


def _new_lazy_group(ranks: list[int] | None, timeout: timedelta) -> Any:
    """A gloo group whose connections are made on first use, pair by pair (``TORCH_GLOO_LAZY_INIT``): a side group
    talks to few peers (ring neighbours, a tree's parent and children, a peer tier's partner), so its sockets and
    set-up time do not grow with the number of ranks (an eager group connects to every rank). The variable is put
    back as it was: the training process group is left as its owner made it."""
    before = os.environ.get(_LAZY)
    os.environ[_LAZY] = "1"
    try:
        return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
    finally:
        if before is None:
            os.environ.pop(_LAZY, None)
        else:
            os.environ[_LAZY] = before


def _as_tensor(data: bytes) -> torch.Tensor:
    """A message as a uint8 tensor of its own (``torch.frombuffer`` refuses an empty buffer)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _wait(work: Any, timeout: timedelta) -> None:
    if work is not None:  # point-to-point calls return None outside a group the rank belongs to
        work.wait(timeout)
