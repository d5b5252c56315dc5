"""The user's script of ``_user_script.py`` with the train loaders new users bring from torchdata and Hugging Face
``datasets`` (``--loader``), and the callbacks of the default preset:

* ``stateful-shuffle``: ``StatefulDataLoader(dataset, shuffle=True)``; under DDP Lightning wraps torchdata's own
  ``RandomSampler`` in its ``DistributedSamplerWrapper``;
* ``stateful-distributed``: ``StatefulDataLoader(dataset, sampler=DistributedSampler(dataset))``, built in the
  datamodule's ``train_dataloader`` (Lightning keeps a ``DistributedSampler`` the user built);
* ``hf-map``: a Hugging Face ``datasets.Dataset`` whose transform draws random jitter, shuffled by a
  ``StatefulDataLoader``;
* ``hf-iterable``: a Hugging Face ``IterableDataset`` (4 shards) split between the ranks with
  ``split_dataset_by_node``, read by a ``StatefulDataLoader`` that saves its state; without workers its ``map``
  draws random jitter (in the main process, whose generators a resume restores), with workers it draws none (their
  generators start anew at a resume: the fit-start warning says so).

Every loader reads the points of ``AugmentedPoints`` (400, batch 8: 25 batches an epoch on each of 2 ranks).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import datasets
import torch
from datasets.distributed import split_dataset_by_node
from lightning.pytorch import LightningDataModule, seed_everything
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from tests.drills._user_code import AugmentedPoints, Regressor, drill_callbacks, parse
from tests.drills._user_script import _restored, default_preset_callbacks, exit_with, fit_and_save, user_trainer

LOADERS = ("stateful-shuffle", "stateful-distributed", "hf-map", "hf-iterable")


def _rows() -> datasets.Dataset:
    points = AugmentedPoints()
    return datasets.Dataset.from_dict({"x": points.x.tolist(), "y": points.y.tolist()})


def _jitter_batch(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    x = torch.tensor(batch["x"])
    return {"x": x + 0.05 * torch.randn_like(x), "y": torch.tensor(batch["y"])}


def _jitter_row(row: dict[str, Any]) -> dict[str, Any]:
    return {"x": (torch.tensor(row["x"]) + 0.05 * torch.randn(16)).tolist()}


class Points(LightningDataModule):
    def __init__(self, loader: str, workers: int) -> None:
        super().__init__()
        self.loader, self.workers = loader, workers

    def train_dataloader(self) -> DataLoader[Any]:
        common: dict[str, Any] = {"batch_size": 8, "num_workers": self.workers}
        if self.loader == "stateful-shuffle":
            return StatefulDataLoader(AugmentedPoints(), shuffle=True, **common)
        if self.loader == "stateful-distributed":
            points = AugmentedPoints()
            return StatefulDataLoader(points, sampler=DistributedSampler(points, shuffle=True), **common)
        if self.loader == "hf-map":
            rows = _rows()
            rows.set_transform(_jitter_batch)
            return StatefulDataLoader(rows, shuffle=True, **common)
        trainer = self.trainer
        assert trainer is not None
        stream = split_dataset_by_node(_rows().to_iterable_dataset(num_shards=4), trainer.global_rank, 2)
        if self.workers == 0:
            stream = stream.map(_jitter_row)
        return StatefulDataLoader(stream.with_format("torch"), **common)


class DictRegressor(Regressor):
    """The user's model, for batches of Hugging Face rows (dicts) as well."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if isinstance(batch, dict):
            batch = (batch["x"].float(), batch["y"].float())
        return super().training_step(batch, batch_idx)


def main(argv: list[str]) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--loader", choices=LOADERS, required=True)
    mine, rest = own.parse_known_args(argv)
    args = parse(rest, __doc__.splitlines()[0])
    datasets.disable_progress_bars()
    # ---- the user's script
    seed_everything(args.seed)
    data, model = Points(mine.loader, args.workers), DictRegressor()
    callbacks = default_preset_callbacks(args.run_dir)
    extra = drill_callbacks(args, _restored)
    return fit_and_save(user_trainer(args, [*callbacks, *extra]), model, data, args)


if __name__ == "__main__":
    exit_with(main(sys.argv[1:]))
