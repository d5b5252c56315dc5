"""Shared training harness for the Lightning tests: a tiny GPT with dropout on shuffled synthetic tokens."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Checkpoint

from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint
from recipes._data import SyntheticTokenDataModule
from recipes._gpt import TinyGPT

TINY = dict(vocab_size=64, seq_len=16, d_model=32, n_layer=1, n_head=2, dropout=0.1, warmup_steps=3, max_steps=40)


class CrashAt(Callback):
    """Raises once ``step`` steps are done, as the next step starts: a crash the test can inject deterministically
    (every callback has finished with step ``step``, the checkpoint callback's snapshot included)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"injected crash at step {self.step}")


class SettlePersists(Callback):
    """Lets this rank's in-flight persist finish before every ``every_n_steps``-th step (bounded by ``timeout``).

    A persist that outlasts the steps until the next one makes the engine defer that one, on every rank, to a later
    step: on a loaded machine the persisted steps would drift, and a test that wants them exactly every ``n`` steps
    settles them. Whether a persist is due at a step's end is agreed from the views contributed at its start (the
    suite's step path, kept last, issues the round): the wait goes before that, at the batch start.
    """

    def __init__(self, every_n_steps: int, timeout: timedelta = timedelta(seconds=30)) -> None:
        self.every_n_steps = every_n_steps
        self.timeout = timeout

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if (trainer.global_step + 1) % self.every_n_steps == 0:
            drain_persists(trainer, self.timeout)


def drain_persists(trainer: Trainer, timeout: timedelta = timedelta(seconds=30)) -> None:
    """Waits (bounded) until this rank's in-flight persist, if any, has committed."""
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(cb, TieredCheckpoint):
            assert cb.manager is not None and cb.manager.wait(timeout), f"persist did not finish within {timeout}"


def build(seed: int = 7) -> tuple[TinyGPT, SyntheticTokenDataModule]:
    seed_everything(seed, workers=True)
    model = TinyGPT(**TINY)
    # 12 batches an epoch: runs cross epoch boundaries and resume mid-epoch; the train loader is what a user
    # writes, DataLoader(dataset, shuffle=True): TieredCheckpoint makes it resumable
    data = SyntheticTokenDataModule(batch_size=4, num_samples=48, seq_len=16, vocab_size=64, seed=3)
    return model, data


def trainer(max_steps: int, callbacks: list[Callback], **kwargs: Any) -> Trainer:
    return Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=kwargs.pop("devices", 1),
        logger=kwargs.pop("logger", False),
        # TieredCheckpoint is a Lightning Checkpoint: with one, Lightning adds no ModelCheckpoint of its own
        enable_checkpointing=any(isinstance(cb, Checkpoint) for cb in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        deterministic=True,
        callbacks=callbacks,
        **kwargs,
    )


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"
