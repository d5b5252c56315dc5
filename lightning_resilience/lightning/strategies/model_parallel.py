"""ResilientModelParallelStrategy: FSDP2 (``fully_shard``) / tensor parallel with per-rank sharded checkpoints that
go through the resilience engine, so ``TieredCheckpoint`` snapshots sharded state every step and
``Trainer.save_checkpoint`` / ``fit(ckpt_path=...)`` write and read one validated shard per rank."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_resilience.checkpoint.standalone import (
    is_checkpoint_dir,
    load_checkpoint_dir,
    remove_checkpoint_dir,
    save_checkpoint_dir,
)
from lightning_resilience.checkpoint.tree import DTensorRebuilder, placement_from_text

__all__ = ["ResilientModelParallelStrategy", "dtensor_rebuilder"]

_SHARDS_IN_PLACE = StateDictOptions(full_state_dict=False, cpu_offload=False)
"""Each rank's own shards, on their device, not copied: what a per-step snapshot reads."""


def dtensor_rebuilder(mesh: DeviceMesh) -> DTensorRebuilder:
    """Rebuild saved shards on ``mesh`` (or the sub-mesh named in the saved layout)."""

    def rebuild(local: torch.Tensor, layout: Mapping[str, Any]) -> DTensor:
        names = tuple(layout["mesh"])
        sub = mesh if not names or names == tuple(mesh.mesh_dim_names or ()) else mesh[names]
        return DTensor.from_local(
            local.to(sub.device_type),
            device_mesh=sub,
            placements=[placement_from_text(p) for p in layout["placements"]],
            run_check=False,
            shape=torch.Size(layout["shape"]),
            stride=tuple(layout["stride"]),
        )

    return rebuild


class ResilientModelParallelStrategy(ModelParallelStrategy):
    """Drop-in :class:`~lightning.pytorch.strategies.ModelParallelStrategy` (FSDP2 / TP) with sharded, checksummed,
    atomic per-rank checkpoints and in-process restore of sharded state.

    Each rank's snapshot holds its own shards (``DTensor`` local tensors plus their layout); restore rebuilds them on
    the strategy's device mesh. The world size must match the one that wrote the checkpoint.
    """

    strategy_name = "resilient_model_parallel"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("save_distributed_checkpoint", True)
        if not kwargs["save_distributed_checkpoint"]:
            raise ValueError("ResilientModelParallelStrategy keeps sharded state: save_distributed_checkpoint=True")
        super().__init__(*args, **kwargs)

    @property
    def rebuild_dtensor(self) -> DTensorRebuilder:
        return dtensor_rebuilder(self.device_mesh)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Lightning asks for cpu_offload=True: a blocking device-to-host copy of the whole shard, which the snapshot
        # would then copy a second time. The shards stay where they are; the snapshot copies them straight into its
        # (pinned) host buffers, beside the next step.
        assert self.model is not None
        return get_model_state_dict(self.model, options=_SHARDS_IN_PLACE)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return get_optimizer_state_dict(self.model, optimizer, options=_SHARDS_IN_PLACE)

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # the parent loads optimizer state inside load_checkpoint; ours goes through load_optimizer_state_dict
        return True

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.model is not None
        set_model_state_dict(self.model, checkpoint["state_dict"], options=StateDictOptions(strict=strict))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.model is not None
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            set_optimizer_state_dict(self.model, optimizer, state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("ResilientModelParallelStrategy.save_checkpoint takes no storage_options")
        save_checkpoint_dir(
            filepath, checkpoint, step=int(checkpoint.get("global_step", 0)), rank=self.global_rank,
            world_size=self.world_size,
        )  # fmt: skip

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if not is_checkpoint_dir(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        state = load_checkpoint_dir(
            checkpoint_path, rank=self.global_rank, world_size=self.world_size, rebuild_dtensor=self.rebuild_dtensor
        )
        assert isinstance(state, dict)
        return state

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        remove_checkpoint_dir(filepath, rank=self.global_rank)
