"""Run under torchrun: a tiny GPT on 2 CPU ranks, FSDP2 (fully_shard) or DDP, with TieredCheckpoint; may crash."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from lightning_resilience import (
    LocalTier,
    MemoryTier,
    ResilientDDPStrategy,
    ResilientModelParallelStrategy,
    TieredCheckpoint,
)
from lightning_resilience.lightning.strategies import model_parallel as model_parallel_module
from recipes._gpt import TinyGPT
from tests.lightning._training import TINY, CrashAt, build, trainer


class ShardedGPT(TinyGPT):
    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


class DrainBefore(Callback):
    def __init__(self, step: int, tiered: TieredCheckpoint) -> None:
        self.step, self.tiered = step, tiered

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:  # after the checkpoint's step end
        if trainer.global_step == self.step and self.tiered.manager is not None:
            self.tiered.manager.wait()
            trainer.strategy.barrier("drain-before-crash")


class SnapshotSources(Callback):
    """Records how every snapshot of the sharded state was taken, and whether its tensors are the parameters' own
    shards (not copies): printed as ``OFFLOAD=`` (the cpu_offload options used) and ``SHARDS_IN_PLACE=``."""

    def __init__(self) -> None:
        self.offload: set[bool] = set()
        self.in_place = True
        strategies = model_parallel_module
        take = strategies.get_model_state_dict

        def recording(model: Any, *args: Any, options: StateDictOptions | None = None, **kwargs: Any) -> Any:
            self.offload.add(bool(options is not None and options.cpu_offload))
            state = take(model, *args, options=options, **kwargs)
            shards = {n: p.to_local().untyped_storage().data_ptr() for n, p in model.named_parameters()}
            self.in_place &= all(state[n].to_local().untyped_storage().data_ptr() == ptr for n, ptr in shards.items())
            return state

        strategies.get_model_state_dict = recording

    def on_train_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_rank == 0:
            print(f"OFFLOAD={sorted(self.offload)} SHARDS_IN_PLACE={int(self.in_place)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--perturb", action="store_true", help="start from other weights (a restore must fix it)")
    parser.add_argument("--ddp", action="store_true")
    args = parser.parse_args()
    _, data = build()  # same seed as the reference: Lightning seeds the DistributedSampler from it
    model: TinyGPT = TinyGPT(**TINY) if args.ddp else ShardedGPT(**TINY)
    if args.perturb:
        gen = torch.Generator().manual_seed(99)  # a private generator: the global RNG streams stay untouched
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen), alpha=0.01)
    callbacks: list[Any] = []
    if args.ckpt is not None:
        callbacks.append(TieredCheckpoint([MemoryTier(1, 2), LocalTier(args.ckpt, every_n_steps=5, keep=2)]))
    if args.ckpt is not None and not args.ddp:
        callbacks.append(SnapshotSources())
    if args.crash_at > 0:
        if callbacks:
            # both ranks commit the last persist before either crashes: once one rank dies the launcher kills the
            # other, and this test is about resuming exactly (the drills cover a kill during a persist)
            callbacks.append(DrainBefore(args.crash_at, callbacks[0]))
        callbacks.append(CrashAt(args.crash_at))
    strategy: Any = (
        ResilientDDPStrategy()
        if args.ddp
        else ResilientModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    )
    t = trainer(args.steps, callbacks, devices=2, strategy=strategy)
    t.fit(model, datamodule=data)
    if args.out is None:
        return
    if args.ddp:
        result = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:  # gathers are collective: every rank takes part, rank 0 keeps the result
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        result = dict(get_model_state_dict(t.strategy.model, options=options))
        osd = get_optimizer_state_dict(t.strategy.model, t.optimizers[0], options=options)
        result.update({f"opt.{k}.{kk}": vv for k, st in osd.get("state", {}).items() for kk, vv in st.items()})
    if t.global_rank == 0:
        torch.save({k: v.clone() for k, v in result.items()}, args.out)
        if callbacks:
            print(f"RESTORED_STEP={callbacks[0].stats.restored_step}", flush=True)


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        # an explicit teardown: left to interpreter exit, gloo's threads can abort the process (SIGABRT)
        torch.distributed.destroy_process_group()
    # every result is written: skip interpreter finalisation, where torch's C++ threads (FSDP2 device-mesh groups)
    # have been seen to abort a finished process ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
