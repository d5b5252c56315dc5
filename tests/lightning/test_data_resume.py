"""TieredCheckpoint resumes a plain DataLoader exactly: every sampler Lightning uses, workers or not, several epochs,
gradient accumulation; a crash mid-epoch (or at an epoch boundary) ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Checkpoint
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from lightning_resilience import LocalTier, MemoryTier, TieredCheckpoint
from lightning_resilience.lightning import _trainer_state
from tests.lightning._training import CrashAt, assert_bitwise_equal, weights

pytestmark = pytest.mark.timeout(240)

# Lightning < 2.5 (NeMo's pin) restarts a snapshot of an epoch's last batch inside that epoch and starts yet another
# epoch after it (the resume says so in a warning, see test_an_inexact_epoch_end_resume_is_said_on_old_lightning);
# mid-epoch snapshots resume exactly there too
_EPOCH_END_ON_OLD_LIGHTNING = pytest.mark.xfail(
    tuple(int(p) for p in lightning.__version__.split(".")[:2]) < (2, 5),
    reason="Lightning < 2.5 does not resume a snapshot taken at an epoch's last batch at the next epoch",
    strict=True,
)

N, BATCH = 44, 4  # 11 batches an epoch, 10 with drop_last... sized so drop_last drops


class NoisyItems(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Each item draws random augmentation from the global torch RNG: in a worker, or in the main process."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(idx)
        x = torch.randn(8, generator=g)
        return x + 0.1 * torch.randn(8), x.mean(0, keepdim=True)


class NoisyRegressor(LightningModule):
    """Dropout and torch.randn noise in training_step, SGD with momentum and a StepLR scheduler."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x + 0.01 * torch.randn_like(x)
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)}


class Data:
    """What a user's train_dataloader() returns, for each variant under test."""

    def __init__(self, variant: str, workers: int, drop_last: bool, persistent: bool) -> None:
        self.variant, self.workers, self.drop_last, self.persistent = variant, workers, drop_last, persistent

    def loader(self) -> DataLoader:
        common: dict[str, Any] = {"num_workers": self.workers, "persistent_workers": self.persistent}
        ds = NoisyItems()
        if self.variant == "shuffle":
            return DataLoader(ds, batch_size=BATCH, shuffle=True, drop_last=self.drop_last, **common)
        if self.variant == "sequential":
            return DataLoader(ds, batch_size=BATCH, sampler=SequentialSampler(ds), drop_last=self.drop_last, **common)
        if self.variant == "generator":
            gen = torch.Generator().manual_seed(17)
            return DataLoader(ds, batch_size=BATCH, shuffle=True, generator=gen, drop_last=self.drop_last, **common)
        if self.variant == "batch_sampler":
            bs = BatchSampler(RandomSampler(ds), batch_size=BATCH, drop_last=self.drop_last)
            return DataLoader(ds, batch_sampler=bs, **common)
        if self.variant == "distributed":  # what Lightning injects under DDP: its order comes from set_epoch
            sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=3)
            return DataLoader(ds, batch_size=BATCH, sampler=sampler, drop_last=self.drop_last, **common)
        if self.variant == "unbatched":
            return DataLoader(ds, batch_size=None, shuffle=True, **common)
        raise AssertionError(self.variant)


class Model(NoisyRegressor):
    def __init__(self, data: Data) -> None:
        super().__init__()
        self.data = data

    def train_dataloader(self) -> DataLoader:
        return self.data.loader()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.data.variant == "unbatched":
            batch = (batch[0].unsqueeze(0), batch[1].unsqueeze(0))
        if isinstance(batch, dict):  # rows of a Hugging Face dataset
            batch = (batch["x"].float(), batch["y"].float())
        return super().training_step(batch, batch_idx)


def _fit(data: Data, steps: int, callbacks: list, seed: int = 7, **kwargs: Any) -> dict[str, torch.Tensor]:
    seed_everything(seed)
    model = Model(data)
    Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        # TieredCheckpoint is a Lightning Checkpoint: with one, Lightning adds no ModelCheckpoint of its own
        enable_checkpointing=any(isinstance(cb, Checkpoint) for cb in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
        **kwargs,
    ).fit(model)
    return weights(model)


def _tiers(root: Path) -> list:
    return [MemoryTier(every_n_steps=1, keep=2), LocalTier(root, every_n_steps=1, keep=2)]


def _crash_and_resume(tmp_path: Path, data: Data, steps: int, crash_at: int, **kwargs: Any) -> dict:
    with pytest.raises(RuntimeError, match="injected crash"):
        _fit(data, steps, [TieredCheckpoint(_tiers(tmp_path)), CrashAt(crash_at)], **kwargs)
    cb = TieredCheckpoint(_tiers(tmp_path))
    resumed = _fit(data, steps, [cb], seed=99, **kwargs)  # a new process starts from other random weights
    assert cb.stats.restored_step == crash_at
    return resumed


CASES = [
    # variant, workers, drop_last, persistent, crash step
    ("shuffle", 0, False, False, 16),
    ("shuffle", 2, False, False, 16),
    ("shuffle", 2, True, True, 26),  # persistent workers, resumed in the third epoch
    ("sequential", 2, True, False, 13),
    ("distributed", 2, False, False, 27),  # in the third epoch: the sampler's epoch decides the order
    ("distributed", 0, True, False, 15),
    ("generator", 0, True, False, 15),
    ("generator", 2, False, False, 15),
    ("batch_sampler", 2, False, False, 14),
    pytest.param("shuffle", 2, False, False, 22, marks=_EPOCH_END_ON_OLD_LIGHTNING),  # at an epoch's end (11 batches)
]


@pytest.mark.parametrize(("variant", "workers", "drop_last", "persistent", "crash_at"), CASES)
def test_plain_dataloader_resumes_bitwise(
    tmp_path: Path, variant: str, workers: int, drop_last: bool, persistent: bool, crash_at: int
) -> None:
    data = Data(variant, workers, drop_last, persistent)
    steps = 34  # three epochs and a bit
    reference = _fit(data, steps, [TieredCheckpoint(_tiers(tmp_path / "ref"))])
    assert_bitwise_equal(_crash_and_resume(tmp_path / "run", data, steps, crash_at), reference)


@pytest.mark.parametrize(("crash_at", "said"), [(22, True), (16, False)])
def test_an_inexact_epoch_end_resume_is_said_on_old_lightning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash_at: int, said: bool
) -> None:
    """On a Lightning that cannot resume a snapshot of an epoch's last batch exactly, the resume says so (and only
    then: a snapshot inside an epoch is exact there too)."""
    monkeypatch.setattr(_trainer_state, "RESUMES_EPOCH_ENDS", False)
    data = Data("shuffle", 0, False, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _crash_and_resume(tmp_path, data, crash_at + 2, crash_at)  # 11 batches an epoch: step 22 ends the second
    messages = [str(w.message) for w in caught if "this resume may not be exact" in str(w.message)]
    assert len(messages) == int(said), messages
    assert not said or f"Lightning {lightning.__version__} (before 2.5)" in messages[0]


def test_unbatched_loader_resumes_bitwise(tmp_path: Path) -> None:
    data = Data("unbatched", 2, False, False)
    reference = _fit(data, 60, [TieredCheckpoint(_tiers(tmp_path / "ref"))])
    assert_bitwise_equal(_crash_and_resume(tmp_path / "run", data, 60, 51), reference)


def test_gradient_accumulation_resumes_bitwise(tmp_path: Path) -> None:
    """Several batches per optimizer step: the position is the batches consumed at the step boundary."""
    data = Data("shuffle", 2, False, False)
    # 11 batches an epoch: optimizer steps after batches 3, 6, 9 and 11; step 6 is the second of the second epoch
    reference = _fit(data, 14, [TieredCheckpoint(_tiers(tmp_path / "ref"))], accumulate_grad_batches=3)
    resumed = _crash_and_resume(tmp_path / "run", data, 14, 6, accumulate_grad_batches=3)
    assert_bitwise_equal(resumed, reference)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(0)
        for _ in range(40):
            x = torch.randn(8, generator=g)
            yield x, x.mean(0, keepdim=True)


def test_iterable_dataset_without_state_is_named_in_one_warning(tmp_path: Path) -> None:
    """Never silently inexact: a loader we cannot resume inside an epoch is named once, at fit start."""

    class StreamModel(NoisyRegressor):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(_Stream(), batch_size=4)

    seed_everything(1)
    trainer = Trainer(
        max_steps=3, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[TieredCheckpoint(_tiers(tmp_path))],
    )  # fmt: skip
    with pytest.warns(UserWarning, match=r"train dataloader 0 \(DataLoader over _Stream\) is not resumable") as rec:
        trainer.fit(StreamModel())
    assert sum("is not resumable inside an epoch" in str(w.message) for w in rec) == 1
    assert "StatefulDataLoader" in str(next(w.message for w in rec if "not resumable" in str(w.message)))
