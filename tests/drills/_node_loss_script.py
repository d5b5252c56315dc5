"""Node-loss drill workload: the tiny GPT on 4 CPU ranks standing in for 2 nodes of 2 ranks, under ``torchrun``.

Run by ``tests/drills/test_node_loss.py`` (``PYTHONPATH`` = repository root)::

    torchrun --nproc-per-node 4 --max-restarts 2 ... tests/drills/_node_loss_script.py --run-dir RUN --steps 20 \\
        [--lose-node-at-step K]

Tiers: RAM every step, a :class:`PeerTier` every step (node RAM, each shard also on the other node) and node-local
disk every 10 steps. ``{node}`` in the paths gives each simulated node its own RAM and disk directories. On the first
attempt at the end of step ``K`` (before step ``K``'s snapshot) every rank settles its persists, then node 1 is lost:
its RAM and disk directories are deleted and both its processes are SIGKILLed. torchrun restarts every worker; the
job must resume from the copies of node 1's shards that node 0 holds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_resilience import LocalTier, MemoryTier, PeerTier, ResilientDDPStrategy, TieredCheckpoint
from lightning_resilience.checkpoint.determinism import ordered_allreduce_hook
from tests.drills._train_script import AttemptReport
from tests.lightning._training import build, trainer, weights

WORLD, RANKS_PER_NODE, DISK_EVERY = 4, 2, 10
SETTLE_LIMIT = timedelta(seconds=60)


class LoseNode(Callback):
    """Once ``step`` is done (the checkpoint callback runs last): settle every rank's persists, record what node 0
    holds, then node 1 disappears."""

    def __init__(self, step: int, run_dir: Path, peer: PeerTier) -> None:
        self.step, self.run_dir, self.peer = step, run_dir, peer

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        tiered = next(c for c in trainer.callbacks if isinstance(c, TieredCheckpoint))
        assert tiered.manager is not None
        if not tiered.manager.wait(SETTLE_LIMIT):
            raise RuntimeError(f"persists in flight at step {self.step} did not finish within {SETTLE_LIMIT}")
        trainer.strategy.barrier("settled")  # every rank's replicas have arrived
        rank = trainer.global_rank
        if rank == 0:
            held = {str(owner): steps for owner, steps in self.peer.inventory().items()}
            (self.run_dir / "node0_before_loss.json").write_text(json.dumps(held))
        if rank == 2:  # the node's RAM and its local disk are gone with it
            shutil.rmtree(self.run_dir / "shm" / "node1")
            shutil.rmtree(self.run_dir / "disk" / "node1")
        trainer.strategy.barrier("node 1 wiped")
        if rank // RANKS_PER_NODE == 1:
            print(f"DRILL: rank {rank} (node 1) lost at step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lose-node-at-step", type=int, default=None)
    args = parser.parse_args(argv)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    node = rank // RANKS_PER_NODE

    peer = PeerTier(
        args.run_dir / "shm" / "node{node}", every_n_steps=1, keep=2, ranks_per_node=RANKS_PER_NODE, timeout_s=60
    )
    tiers = [
        MemoryTier(every_n_steps=1, keep=2),
        peer,
        LocalTier(args.run_dir / "disk" / f"node{node}", every_n_steps=DISK_EVERY, keep=2),
    ]
    callbacks: list[Callback] = []
    if args.lose_node_at_step is not None and attempt == 0:  # before TieredCheckpoint: no snapshot of step K
        callbacks.append(LoseNode(args.lose_node_at_step, args.run_dir, peer))
    callbacks += [
        TieredCheckpoint(tiers),
        AttemptReport(args.run_dir / f"attempt{attempt}_rank{rank}.json", {"attempt": attempt, "rank": rank}),
    ]
    model, data = build()
    # with more than two ranks, DDP's all-reduce sums in a bucket-layout-dependent order, and DDP rebuilds its
    # buckets after the first step of every run: the ordered reduction keeps the resumed run bitwise exact
    strategy = ResilientDDPStrategy(ddp_comm_hook=ordered_allreduce_hook)
    fit = trainer(args.steps, callbacks, devices=WORLD, strategy=strategy)
    fit.fit(model, datamodule=data)
    if fit.global_rank == 0:
        tmp = args.run_dir / "weights.tmp"
        torch.save(weights(model), tmp)
        os.replace(tmp, args.run_dir / "weights.pt")
    tiered = next(c for c in callbacks if isinstance(c, TieredCheckpoint))
    report = {"recovered": peer.recovered, "restored_from": tiered.stats.restored_from}
    (args.run_dir / f"peer{attempt}_rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
