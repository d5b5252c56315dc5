"""Reading small device values on the host without stalling the CPU: a copy into pinned memory now, a read later.

On a GPU the CPU queues work ahead of the device; ``float(t)`` or ``t.item()`` on a device tensor makes it wait until
the device has caught up. :class:`HostStage` instead queues a non-blocking copy of a few scalars into pinned host
memory and records an event; :meth:`HostStage.ready` hands back the values whose copy has landed, without waiting.
On the CPU nothing needs to wait: each value is read at once (a read of a CPU scalar costs less than stacking the
values and copying the stack), and every reading is ready at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["READ_AT_ONCE", "HostStage", "to_host"]

READ_AT_ONCE = frozenset({"cpu"})
"""Device types whose values :meth:`HostStage.put` reads at once (their memory is the host's)."""


@dataclass
class _Read:
    """A reading of host values, taken when it was put (nothing to wait for)."""

    key: Hashable
    values: list[float]
    event: None = None

    def take(self) -> list[float]:
        return self.values


@dataclass
class _Staged:
    key: Hashable
    gathered: torch.Tensor
    """Where the values were stacked on their device (reused once read, as :attr:`host`)."""
    host: torch.Tensor
    event: torch.cuda.Event | None
    pool: list[tuple[torch.Tensor, torch.Tensor]]
    """Where the two buffers go back once the reading is taken."""

    def take(self) -> list[float]:
        """The values (the copy has landed); the buffers go back to the pool."""
        self.pool.append((self.gathered, self.host))
        return self.host.tolist()


class HostStage:
    """A FIFO of device values on their way to the host.

    Args:
        max_pending: readings allowed in flight; :meth:`put` beyond it makes :meth:`ready` wait for the oldest
            (a host wait, counted in :attr:`forced_reads`), so a device far behind cannot grow the queue forever.
    """

    def __init__(self, max_pending: int = 4) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._pending: deque[_Staged | _Read] = deque()
        self._free: dict[tuple[torch.device, torch.dtype, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.forced_reads = 0
        """Readings that had to be waited for because ``max_pending`` were in flight."""

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, key: Hashable, values: Sequence[torch.Tensor], dtype: torch.dtype = torch.float64) -> None:
        """Queue a copy of ``values`` (0-d tensors on one device), as ``dtype``, to the host; nothing waits. Two
        operations a reading, paid on the training thread: the values are stacked into a buffer on their device, which
        is copied into a host buffer (pinned on a GPU); both are reused once the reading is taken. Values on the CPU
        are read at once, converted to ``dtype`` (a float or an integer)."""
        device = values[0].device
        if device.type in READ_AT_ONCE:
            cast = float if dtype.is_floating_point else int
            self._pending.append(_Read(key, [cast(v) for v in values]))
            return
        pool = self._free.setdefault((device, dtype, len(values)), [])
        if pool:
            gathered, host = pool.pop()
        else:
            gathered = torch.empty(len(values), dtype=dtype, device=device)
            host = torch.empty(len(values), dtype=dtype, pin_memory=device.type == "cuda")
        with torch.no_grad():
            torch.stack(list(values), out=gathered)
        host.copy_(gathered, non_blocking=True)  # from a host buffer: done when it returns
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._pending.append(_Staged(key, gathered, host, event, pool))

    def ready(self) -> list[tuple[Hashable, list[float]]]:
        """The readings whose copy has landed, oldest first, removed from the queue (never waits, except for the
        oldest readings beyond ``max_pending``)."""
        out: list[tuple[Hashable, list[float]]] = []
        while self._pending:
            head = self._pending[0]
            if head.event is not None and not head.event.query():
                if len(self._pending) <= self.max_pending:
                    break
                head.event.synchronize()
                self.forced_reads += 1
            self._pending.popleft()
            out.append((head.key, head.take()))
        return out

    def drain(self) -> list[tuple[Hashable, list[float]]]:
        """Every pending reading, waiting for those still in flight (at the end of training)."""
        for staged in self._pending:
            if staged.event is not None:
                staged.event.synchronize()
        out = [(s.key, s.take()) for s in self._pending]
        self._pending.clear()
        return out

    def clear(self) -> None:
        self._pending.clear()


def to_host(rows: list[torch.Tensor]) -> torch.Tensor:
    """Stack equally shaped tensors into one host tensor with one device-to-host copy per device (not one per row).

    A row already on the host costs nothing. Meant for the steps that must read device values (a due replay or
    reconciliation): one read, however many tensors were digested.
    """
    if not rows:
        raise ValueError("to_host needs at least one row")
    by_device: dict[torch.device, list[int]] = {}
    for i, row in enumerate(rows):
        by_device.setdefault(row.device, []).append(i)
    if len(by_device) == 1:
        return torch.stack(rows).cpu()
    out = torch.empty((len(rows), *rows[0].shape), dtype=rows[0].dtype)
    for index in by_device.values():
        out[index] = torch.stack([rows[i] for i in index]).cpu()
    return out
