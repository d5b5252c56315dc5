"""TieredCheckpoint resumes stateful loaders exactly: torchdata's ``StatefulDataLoader`` over a map-style dataset
(shuffled, with a user's ``DistributedSampler``, with and without workers), over a Hugging Face ``datasets.Dataset``
and over a Hugging Face ``IterableDataset`` with state; a crash mid-epoch ends bitwise equal to an uninterrupted
run, also across the epochs after the resumed one. The 2-rank versions under torchrun are the drills of
``tests/drills/test_loader_drills.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from lightning_resilience import TieredCheckpoint
from tests.lightning._training import assert_bitwise_equal
from tests.lightning.test_data_resume import BATCH, Data, NoisyItems, _crash_and_resume, _fit, _tiers

stateful = pytest.importorskip("torchdata.stateful_dataloader")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.timeout(240)


def _hf_rows(n: int = 44) -> Any:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 8, generator=g)
    return datasets.Dataset.from_dict({"x": x.tolist(), "y": x.mean(1, keepdim=True).tolist()})


def _jitter(row: dict[str, Any]) -> dict[str, Any]:
    # random augmentation drawn while loading (in the main process or in a worker)
    return {"x": (torch.tensor(row["x"]) + 0.1 * torch.randn(8)).tolist(), "y": row["y"]}


class StatefulData(Data):
    """A user's train loader built on torchdata and Hugging Face datasets."""

    def loader(self) -> DataLoader:
        kwargs: dict[str, Any] = {"batch_size": BATCH, "num_workers": self.workers}
        kwargs["persistent_workers"] = self.persistent
        if self.variant == "shuffle":
            return stateful.StatefulDataLoader(NoisyItems(), shuffle=True, **kwargs)
        if self.variant == "distributed":
            sampler = DistributedSampler(NoisyItems(), num_replicas=1, rank=0, shuffle=True, seed=3)
            return stateful.StatefulDataLoader(NoisyItems(), sampler=sampler, **kwargs)
        if self.variant == "stateful_distributed":  # a sampler with a state of its own, which we supersede
            sampler = stateful.sampler.StatefulDistributedSampler(NoisyItems(), num_replicas=1, rank=0, seed=3)
            return stateful.StatefulDataLoader(NoisyItems(), sampler=sampler, **kwargs)
        if self.variant == "hf_map":
            ds = _hf_rows().with_format("torch")
            ds.set_transform(
                lambda b: {"x": torch.tensor(b["x"]) + 0.1 * torch.randn(len(b["x"]), 8), "y": torch.tensor(b["y"])}
            )
            return stateful.StatefulDataLoader(ds, shuffle=True, **kwargs)
        if self.variant == "hf_iterable":
            ds = _hf_rows().to_iterable_dataset(num_shards=2)
            ds = (ds.map(_jitter) if self.workers == 0 else ds).with_format("torch")
            return stateful.StatefulDataLoader(ds, **kwargs)
        raise AssertionError(self.variant)


CASES = [
    # variant, workers, persistent, crash step (11 or 12 batches an epoch: every crash is in the second epoch)
    ("shuffle", 0, False, 16),
    ("shuffle", 2, False, 16),
    ("distributed", 2, True, 15),
    ("stateful_distributed", 0, False, 15),
    ("hf_map", 2, False, 17),
    ("hf_iterable", 0, False, 17),
    ("hf_iterable", 2, False, 17),
    ("hf_iterable", 2, True, 13),
]


@pytest.mark.parametrize(("variant", "workers", "persistent", "crash_at"), CASES)
def test_stateful_loader_resumes_bitwise(
    tmp_path: Path, variant: str, workers: int, persistent: bool, crash_at: int
) -> None:
    data = StatefulData(variant, workers, False, persistent)
    steps = 40  # past the resumed epoch: the next one starts from the beginning
    reference = _fit(data, steps, [TieredCheckpoint(_tiers(tmp_path / "ref"))])
    assert_bitwise_equal(_crash_and_resume(tmp_path / "run", data, steps, crash_at), reference)
