"""Elastic drill workload: the tiny GPT under ``torchrun`` on any number of CPU ranks, checkpointing to a shared
directory; a later run with another number of ranks must continue from it (resharded, data position remapped).

    torchrun --nproc-per-node W tests/drills/_elastic_script.py --ckpt-dir DIR --out OUT.json --steps S
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch

from lightning_resilience import LocalTier, MemoryTier, ResilientDDPStrategy, TieredCheckpoint
from tests.lightning._training import build, trainer


class _Remaps(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args(argv)
    remaps = _Remaps()
    logging.getLogger("lightning_resilience.checkpoint.dataloader").addHandler(remaps)
    logging.getLogger("lightning_resilience.checkpoint.dataloader").setLevel(logging.INFO)
    world = int(os.environ["WORLD_SIZE"])
    tiered = TieredCheckpoint([MemoryTier(every_n_steps=1, keep=2), LocalTier(args.ckpt_dir, every_n_steps=5, keep=3)])
    model, data = build()
    fit = trainer(args.steps, [tiered], devices=world, strategy=ResilientDDPStrategy())
    fit.fit(model, datamodule=data)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    result = {
        "world": world,
        "restored_step": tiered.stats.restored_step,
        "restored_from": tiered.stats.restored_from,
        "final_step": fit.global_step,
        "finite": finite,
        "remaps": remaps.messages,
    }
    rank = int(os.environ["RANK"])
    args.out.with_name(f"{args.out.stem}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
