"""Reading small device values on the host without stalling the CPU: a copy into pinned memory now, a read later.

On a GPU the CPU queues work ahead of the device; ``float(t)`` or ``t.item()`` on a device tensor makes it wait until
the device has caught up. :class:`HostStage` instead queues a non-blocking copy of a few scalars into pinned host
memory and records an event; :meth:`HostStage.ready` hands back the values whose copy has landed, without waiting.
On the CPU the copy is immediate and every value is ready at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

import torch

__all__ = ["HostStage", "to_host"]


@dataclass
class _Staged:
    key: Hashable
    host: torch.Tensor
    event: torch.cuda.Event | None


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
        self._pending: deque[_Staged] = deque()
        self.forced_reads = 0
        """Readings that had to be waited for because ``max_pending`` were in flight."""

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, key: Hashable, values: torch.Tensor) -> None:
        """Queue a copy of ``values`` (a 1-D tensor on any device) to the host; nothing waits."""
        values = values.detach().reshape(-1)
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = torch.empty(values.shape, dtype=values.dtype)
            host.copy_(values, non_blocking=True)  # a host copy: done when it returns
            event = None
        self._pending.append(_Staged(key, host, event))

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
            out.append((head.key, head.host.tolist()))
        return out

    def drain(self) -> list[tuple[Hashable, list[float]]]:
        """Every pending reading, waiting for those still in flight (at the end of training)."""
        for staged in self._pending:
            if staged.event is not None:
                staged.event.synchronize()
        out = [(s.key, s.host.tolist()) for s in self._pending]
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
