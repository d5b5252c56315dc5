"""The user's script of ``_user_script.py`` (default preset, plain ``DataLoader(shuffle=True)``, DDP under torchrun)
with one poisoned sample: whenever index ``ROLLBACK_DRILL_POISON`` is loaded its features are NaN, so the loss of the
rank that loads it is NaN (the drill for in-process rollback).

``ROLLBACK_DRILL_DROP=<position>`` makes the reference run instead: the user's loader gets a ``DistributedSampler``
of its own (the one Lightning would inject, same seed) whose epoch-0 index list leaves out batch ``<position>`` on
every rank, so that run never sees the poisoned sample nor the batches that shared its step.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import DataLoader, DistributedSampler

from tests.drills._user_code import AugmentedPoints, Regressor, drill_callbacks, parse
from tests.drills._user_script import _restored, default_preset_callbacks, exit_with, fit_and_save

BATCH = 8


class PoisonedPoints(AugmentedPoints):
    """``AugmentedPoints`` whose sample ``poison`` has NaN features."""

    def __init__(self, poison: int) -> None:
        super().__init__()
        self.poison = poison

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(idx)
        return (x * float("nan"), y) if idx == self.poison else (x, y)


class WithoutBatch(DistributedSampler[Any]):
    """Lightning's ``DistributedSampler`` with batch ``position`` of epoch 0 left out of this rank's index list."""

    def __init__(self, dataset: Any, position: int) -> None:
        super().__init__(
            dataset,
            num_replicas=int(os.environ["WORLD_SIZE"]),
            rank=int(os.environ["RANK"]),
            shuffle=True,
            seed=int(os.environ.get("PL_GLOBAL_SEED", "0")),
        )
        self.position = position

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())
        if self.epoch == 0:
            del indices[self.position * BATCH : (self.position + 1) * BATCH]
        return iter(indices)

    def __len__(self) -> int:
        return super().__len__() - (BATCH if self.epoch == 0 else 0)


def main(argv: list[str]) -> int:
    args = parse(argv, __doc__.splitlines()[0])
    seed_everything(args.seed)
    dataset = PoisonedPoints(int(os.environ["ROLLBACK_DRILL_POISON"]))
    drop = os.environ.get("ROLLBACK_DRILL_DROP")
    if drop is None:  # the user's loader
        loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=args.workers)
    else:  # the reference: a loader that never yields the dropped batch
        sampler = WithoutBatch(dataset, int(drop))
        loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=args.workers)
    model = Regressor()
    trainer = Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp",
        use_distributed_sampler=drop is None,
        callbacks=[*default_preset_callbacks(args.run_dir), *drill_callbacks(args, _restored)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(args.run_dir),
    )
    return fit_and_save(trainer, model, loader, args)


if __name__ == "__main__":
    exit_with(main(sys.argv[1:]))
