"""The README's first example as a user writes it: ``TieredCheckpoint`` alone (a RAM tier and a local-disk tier at a
path of the user's, outside any run directory), Lightning's default strategy (DDP under torchrun), a plain
``DataLoader(shuffle=True)``; nothing else of ours.

The drills add a kill (``--kill-rank R --kill-steps 12,24,36``: rank R SIGKILLs itself as step K + 1 starts, once
for each K, across restarts and requeues; ``--always-kill-step K``: on every attempt), an optional remote tier
(``--remote URL``: an fsspec directory standing for an object store; with ``--remote-only`` it is the only
persistent tier), and a line per attempt in ``--out/env_rank<R>.jsonl`` with what torchrun's contract told the rank
(``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``) and whether the suite gave
the attempt a store of its own (``LIGHTNING_RESILIENCE_ATTEMPT_STORE``), the rank's other torchrun variables, its
pid, and the rank Lightning read when it was imported (``rank_zero_only.rank``). Rank 0 of the attempt that finishes
writes ``--out/weights.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader

from lightning_resilience import LocalTier, MemoryTier, RemoteTier, TieredCheckpoint
from lightning_resilience.ft.rendezvous import SCOPED_STORE_ENV
from tests.drills._user_code import AugmentedPoints, Regressor

PERSIST_EVERY = 4


class _Kill(Callback):
    """SIGKILL rank ``rank`` as step K + 1 starts, once for each K in ``steps`` (a marker file per step survives the
    restarts and requeues), and on every attempt at ``always`` (a job that cannot get past it)."""

    def __init__(self, rank: int, steps: list[int], always: int | None, markers: Path) -> None:
        self.rank, self.steps, self.always, self.markers = rank, steps, always, markers

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        marker = self.markers / f"killed_at_{step}"
        due = step == self.always or (step in self.steps and not marker.exists())
        if trainer.global_rank != self.rank or not due:
            return
        tiered = next(c for c in trainer.callbacks if isinstance(c, TieredCheckpoint))  # type: ignore[attr-defined]
        assert tiered.manager is not None
        tiered.manager.wait()  # the persist in flight lands: the progress it made is there to be seen
        marker.touch()
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(f"DRILL: rank {self.rank} SIGKILL at step {step} (attempt {attempt})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-steps", default="")
    parser.add_argument("--always-kill-step", type=int, default=None)
    parser.add_argument("--remote", default=None)
    parser.add_argument("--remote-only", action="store_true")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    rank_at_import = getattr(rank_zero_only, "rank", None)  # read from RANK when Lightning was imported
    args.out.mkdir(parents=True, exist_ok=True)
    # ---- the README's example
    seed_everything(7)
    tiers: list[Any] = [MemoryTier(every_n_steps=1, keep=2)]
    if not args.remote_only:
        tiers.append(LocalTier(str(args.ckpt), every_n_steps=PERSIST_EVERY, keep=3))
    if args.remote:
        tiers.append(RemoteTier(args.remote, every_n_steps=PERSIST_EVERY, keep=3))
    kill = [int(s) for s in args.kill_steps.split(",") if s]
    trainer = Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        callbacks=[TieredCheckpoint(tiers=tiers), _Kill(args.kill_rank, kill, args.always_kill_step, args.out)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(args.out / "lightning"),
    )
    with open(args.out / f"env_rank{rank}.jsonl", "a") as f:  # the callbacks are built, the process group is not
        names = ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", SCOPED_STORE_ENV,
                 "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
        seen = {n: os.environ.get(n) for n in names}
        f.write(json.dumps({**seen, "pid": os.getpid(), "rank_zero_only_at_import": rank_at_import}) + "\n")
    model = Regressor()
    trainer.fit(model, DataLoader(AugmentedPoints(), batch_size=8, shuffle=True))
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out / "weights.pt")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # before interpreter exit: gloo's threads can abort it
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
