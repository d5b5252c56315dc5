"""A DDP gradient reduction whose result does not depend on how gradients are bucketed.

DDP sums gradients with a ring all-reduce over each bucket; which rank's value is added in which order depends on
where an element falls in its bucket. DDP rebuilds its buckets after the first iteration in the order gradients
became ready, so a job resumed from a checkpoint runs its first step with different buckets than the uninterrupted
job ran that step with. With two ranks that is harmless (``a + b == b + a`` in floating point); with three or more
the sums differ in the last bits and a resumed run is no longer bitwise equal to an uninterrupted one.

:func:`ordered_allreduce_hook` all-gathers each bucket and adds the ranks' values in rank order, so every element is
reduced as ``((g0 + g1) + g2) + ...`` whatever the bucket layout. It moves ``world_size`` times the data of an
all-reduce: meant for exact-resume drills, reproducibility studies and small jobs, not for bandwidth-bound training.

Example::

    Trainer(strategy=ResilientDDPStrategy(ddp_comm_hook=ordered_allreduce_hook), ...)
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations as objects
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ordered_allreduce_hook"]


def ordered_allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the mean of the ranks' gradients, summed in rank order (``state``: a group or None)."""
    group = state if isinstance(state, dist.ProcessGroup) else None
    world = dist.get_world_size(group)
    local = bucket.buffer()
    parts = [torch.empty_like(local) for _ in range(world)]
    work = dist.all_gather(parts, local, group=group, async_op=True)
    assert work is not None

    def reduce(_: torch.futures.Future[Any]) -> torch.Tensor:
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        return local.copy_(total.div_(world))

    return work.get_future().then(reduce)
