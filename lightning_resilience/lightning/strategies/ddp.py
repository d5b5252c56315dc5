"""ResilientDDPStrategy: DDP whose ``Trainer.save_checkpoint`` / ``fit(ckpt_path=...)`` write and read one
validated shard per rank (so per-rank state such as RNG streams and data position survives), and whose process
group comes up again after a torchrun restart."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_resilience.checkpoint.standalone import (
    is_checkpoint_dir,
    load_checkpoint_dir,
    remove_checkpoint_dir,
    save_checkpoint_dir,
)
from lightning_resilience.ft.rendezvous import attempt_store

__all__ = ["ResilientDDPStrategy"]


class ResilientDDPStrategy(DDPStrategy):
    """Drop-in :class:`~lightning.pytorch.strategies.DDPStrategy` with sharded, checksummed, atomic checkpoints.

    Every rank writes its own shard (``<path>/rank_XXXXX``) instead of rank 0 writing one file; loading validates
    the shard and never unpickles arbitrary objects. Paths that hold a plain Lightning ``.ckpt`` file still load
    through the normal ``CheckpointIO``.
    """

    strategy_name = "resilient_ddp"

    @override
    def setup_distributed(self) -> None:
        # Under torchrun's static rendezvous (and c10d with a shared store) every attempt's workers meet in the agent's
        # store, where the previous attempt's gloo addresses are still written: a restart then hangs or fails in
        # init_process_group. A store prefixed with the attempt makes each restart's keys its own.
        store = None if dist.is_initialized() else attempt_store(self._timeout)
        if store is not None:
            self.set_world_ranks()
            dist.init_process_group(
                self._get_process_group_backend(),
                store=store,
                rank=self.global_rank,
                world_size=self.world_size,
                timeout=self._timeout,
                device_id=self.root_device if self.root_device.type != "cpu" else None,
            )
        super().setup_distributed()  # seeds, ranks, backend name; finds the group initialised and keeps it

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        # Lightning registers ``ddp_comm_hook`` on CUDA only; gloo runs communication hooks too, and CPU jobs need
        # them as much (e.g. ``ordered_allreduce_hook`` for a bitwise exact resume with three or more ranks)
        if self.root_device.type != "cuda" and self._ddp_comm_hook is not None:
            if self._ddp_comm_wrapper is not None:
                raise ValueError("ResilientDDPStrategy: ddp_comm_wrapper (gradient compression) needs CUDA")
            assert isinstance(self.model, DistributedDataParallel)
            self.model.register_comm_hook(state=self._ddp_comm_state, hook=self._ddp_comm_hook)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "ResilientDDPStrategy.save_checkpoint takes no storage_options; configure tiers on TieredCheckpoint"
            )
        save_checkpoint_dir(
            filepath,
            checkpoint,
            step=int(checkpoint.get("global_step", 0)),
            rank=self.global_rank,
            world_size=self.world_size,
        )

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if not is_checkpoint_dir(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=True)
        state = load_checkpoint_dir(checkpoint_path, rank=self.global_rank, world_size=self.world_size)
        assert isinstance(state, dict)
        return state

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        remove_checkpoint_dir(filepath, rank=self.global_rank)
