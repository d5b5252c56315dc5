"""Tests for the TinyGPT recipe model and its synthetic data."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from recipes._data import SyntheticTokenDataModule, SyntheticTokens
from recipes._gpt import TinyGPT, WarmupCosineLambda, count_parameters, gpt_preset


class _LossRecorder(Callback):
    """Collects the per-step training loss returned by ``training_step``."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))


def test_forward_shape_and_finite_loss() -> None:
    torch.manual_seed(0)
    cfg = gpt_preset("tiny")
    model = TinyGPT(**cfg)
    batch = SyntheticTokens(4, cfg["seq_len"], cfg["vocab_size"], seed=0)
    tokens = torch.stack([batch[i] for i in range(4)])
    assert tokens.shape == (4, cfg["seq_len"] + 1)
    logits = model(tokens[:, :-1])
    assert logits.shape == (4, cfg["seq_len"], cfg["vocab_size"])
    loss = model.compute_loss(tokens)
    assert torch.isfinite(loss)
    # An untrained model should be close to uniform over the vocabulary.
    assert abs(loss.item() - torch.log(torch.tensor(float(cfg["vocab_size"]))).item()) < 1.0


def test_training_reduces_loss() -> None:
    torch.manual_seed(0)
    cfg = gpt_preset("tiny")
    # A hotter, shorter schedule than the preset so 20 steps show a clear drop on CPU.
    cfg.update(lr=3e-3, warmup_steps=2, max_steps=20)
    model = TinyGPT(**cfg)
    dm = SyntheticTokenDataModule(batch_size=16, num_samples=512, seq_len=cfg["seq_len"], vocab_size=cfg["vocab_size"])
    recorder = _LossRecorder()
    trainer = Trainer(
        max_steps=20,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[recorder],
    )
    trainer.fit(model, datamodule=dm)
    losses = recorder.losses
    assert len(losses) == 20
    assert all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.05, f"loss did not decrease: first3={first:.3f} last3={last:.3f}"


def test_dataset_is_deterministic() -> None:
    ds_a = SyntheticTokens(32, 64, 256, seed=7)
    ds_b = SyntheticTokens(32, 64, 256, seed=7)
    ds_other = SyntheticTokens(32, 64, 256, seed=8)
    for i in (0, 5, 31):
        item = ds_a[i]
        assert item.dtype == torch.long
        assert item.shape == (65,)
        assert int(item.min()) >= 0 and int(item.max()) < 256
        assert torch.equal(item, ds_b[i])
        assert not torch.equal(item, ds_other[i])
    # Different indices of the same dataset are different sequences too.
    assert not torch.equal(ds_a[0], ds_a[1])


def test_datamodule_uses_loader_factory() -> None:
    calls: list[dict[str, Any]] = []

    class RecordingLoader(torch.utils.data.DataLoader):  # type: ignore[type-arg]
        def __init__(self, dataset: Any, **kwargs: Any) -> None:
            calls.append(kwargs)
            super().__init__(dataset, **kwargs)

    dm = SyntheticTokenDataModule(batch_size=4, num_samples=64, loader_cls=RecordingLoader)
    loader = dm.train_dataloader()
    assert isinstance(loader, RecordingLoader)
    assert calls == [{"batch_size": 4, "shuffle": True, "num_workers": 0, "drop_last": True}]
    assert next(iter(loader)).shape == (4, 65)
    val = dm.val_dataloader()
    assert len(val.dataset) == 4  # type: ignore[arg-type]
    # Validation items are held out: they come after the training indices of the same seeded stream.
    assert not any(torch.equal(val.dataset[0], dm.train_dataset[i]) for i in range(64))


def test_lr_schedule_warmup_then_cosine_floor() -> None:
    fn = WarmupCosineLambda(warmup_steps=10, max_steps=100, min_ratio=0.1)
    assert fn(0) == pytest.approx(0.1)
    assert fn(9) == pytest.approx(1.0)
    assert fn(10) == pytest.approx(1.0)
    assert fn(100) == pytest.approx(0.1)
    assert fn(1000) == pytest.approx(0.1)


def test_small_preset_parameter_count() -> None:
    model = TinyGPT(**gpt_preset("small"))
    n_params = count_parameters(model)
    assert 20_000_000 <= n_params <= 30_000_000, n_params
    assert n_params == 23_175_168
    assert count_parameters(TinyGPT(**gpt_preset("tiny"))) == 437_760


def test_unknown_preset_raises() -> None:
    with pytest.raises(ValueError, match="huge"):
        gpt_preset("huge")
