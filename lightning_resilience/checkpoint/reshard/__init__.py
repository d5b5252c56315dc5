"""Resharding: restore a checkpoint written by N ranks on a job of M ranks.

A step directory holds one independent shard per rank (see :mod:`lightning_resilience.checkpoint.format`). Each
shard stores its DTensors as the local piece plus its layout (placements, global shape, mesh shape, the rank's
coordinate on the mesh), so the pieces of all N shards together describe every sharded tensor globally. Resharding
builds, for a new rank ``r`` of ``M``:

* **Sharded state** (DTensor entries: FSDP2 parameters and optimizer state): the slice that rank ``r`` owns on the
  new mesh, read through DCP. A global DCP :class:`~torch.distributed.checkpoint.metadata.Metadata` is synthesized
  from the N per-rank ``.metadata`` files (one chunk per distinct source piece, at its global offset, pointing at the
  source rank's file) and loaded with DCP's planner: each rank alone (``no_dist``) into plain tensors sized to its
  slice (:func:`load_resharded`, what :func:`restore_resharded` uses; no collective), or collectively into DTensors
  the caller allocated on the new mesh (:func:`load_into`, the stock :class:`DefaultLoadPlanner`).
* **Everything else** (plain tensors and the JSON skeleton: DDP model and optimizer, loop counters, RNG streams,
  data-loader positions) is taken from one source rank, ``r % N``. Replicated state (DDP) is equal on every source
  rank, so this is exact. Per-rank state (RNG streams, a sampler's position) cannot be exact across a world-size
  change: new rank ``r`` continues the streams of old rank ``r % N``.

The mesh on M ranks keeps the source mesh's inner dimensions and scales the outermost one (``(dp, tp) = (2, 2)`` on
4 ranks becomes ``(1, 2)`` on 2); rank ``r`` sits at the row-major coordinate of ``r`` on it, as with
``init_device_mesh``. :func:`plan_reshard` checks all of this from manifests and skeletons only, before any tensor is
read, and raises :class:`ReshardError` naming the first problem.
"""

from lightning_resilience.checkpoint.reshard.agree import restore_resharded_agreed
from lightning_resilience.checkpoint.reshard.load import (
    Resharded,
    load_into,
    load_resharded,
    reshardable_steps,
    restore_resharded,
)
from lightning_resilience.checkpoint.reshard.plan import (
    ReshardError,
    ReshardPlan,
    ShardedEntry,
    local_slice,
    plan_reshard,
)
from lightning_resilience.checkpoint.reshard.plan import (
    _unravel as _unravel,
)

__all__ = [
    "ReshardError",
    "ReshardPlan",
    "Resharded",
    "ShardedEntry",
    "load_into",
    "load_resharded",
    "local_slice",
    "plan_reshard",
    "reshardable_steps",
    "restore_resharded",
    "restore_resharded_agreed",
]
