"""A crashed and resumed run ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_resilience import CheckpointConfig, LocalTier, MemoryTier, TieredCheckpoint
from tests.lightning._training import CrashAt, assert_bitwise_equal, build, trainer, weights

STEPS = 30


def _reference() -> dict:
    model, data = build()
    trainer(STEPS, []).fit(model, datamodule=data)
    return weights(model)


@pytest.fixture(scope="module")
def reference() -> dict:
    return _reference()


def _tiers(root: Path) -> list:
    return [MemoryTier(every_n_steps=1, keep=2), LocalTier(root, every_n_steps=5, keep=2)]


@pytest.mark.parametrize("crash_at", [17, 24])  # mid-epoch, and exactly on an epoch boundary (12 batches an epoch)
def test_resume_after_crash_is_bitwise_exact(tmp_path: Path, reference: dict, crash_at: int) -> None:
    model, data = build()
    with pytest.raises(RuntimeError, match="injected crash"):
        trainer(STEPS, [TieredCheckpoint(_tiers(tmp_path)), CrashAt(crash_at)]).fit(model, datamodule=data)

    model, data = build(seed=99)  # a fresh process would start from different random weights
    cb = TieredCheckpoint(_tiers(tmp_path))
    t = trainer(STEPS, [cb])
    t.fit(model, datamodule=data)
    # the newest persist before the crash; under load a busy worker defers it a step or two (possibly to the
    # crash step itself, whose snapshot is taken before the crash), never skips it
    assert cb.stats.restored_step is not None and (crash_at // 5) * 5 <= cb.stats.restored_step <= crash_at
    assert cb.stats.restored_from == "local"
    assert t.global_step == STEPS
    assert_bitwise_equal(weights(model), reference)


def test_resume_never_starts_fresh(tmp_path: Path) -> None:
    model, data = build()
    trainer(10, [TieredCheckpoint(_tiers(tmp_path))]).fit(model, datamodule=data)
    model, data = build()
    cb = TieredCheckpoint(_tiers(tmp_path), resume="never")
    t = trainer(3, [cb])
    t.fit(model, datamodule=data)
    assert cb.stats.restored_step is None
    assert t.global_step == 3


def test_exception_saves_the_newest_ram_snapshot(tmp_path: Path, reference: dict) -> None:
    """A crash between disk cadences loses nothing: the step snapshotted before it is saved from RAM."""
    model, data = build()
    tiers = [MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path, every_n_steps=100, keep=2)]
    with pytest.raises(RuntimeError, match="injected crash"):
        trainer(STEPS, [TieredCheckpoint(tiers), CrashAt(13)]).fit(model, datamodule=data)

    model, data = build(seed=99)
    cb = TieredCheckpoint([LocalTier(tmp_path, every_n_steps=100, keep=2)])
    trainer(STEPS, [cb]).fit(model, datamodule=data)
    assert (cb.stats.restored_step, cb.stats.restored_from) == (13, "local")
    assert_bitwise_equal(weights(model), reference)


def test_exception_save_can_be_turned_off(tmp_path: Path) -> None:
    model, data = build()
    tiers = [MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path, every_n_steps=100, keep=2)]
    cb = TieredCheckpoint(tiers, config=CheckpointConfig(save_on_exception=False))
    with pytest.raises(RuntimeError, match="injected crash"):
        trainer(STEPS, [cb, CrashAt(13)]).fit(model, datamodule=data)
    assert tiers[1].list_steps() == []


class _SaveAt(Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def test_the_newer_of_ckpt_path_and_our_steps_wins(tmp_path: Path, reference: dict) -> None:
    """A relaunched script that names a fixed ``ckpt_path`` (or NeMo's ``resume_if_exists``) continues from our
    newer step; a ``ckpt_path`` newer than anything of ours is taken as it is."""
    old = tmp_path / "step4.ckpt"
    model, data = build()
    with pytest.raises(RuntimeError, match="injected crash"):
        trainer(STEPS, [TieredCheckpoint(_tiers(tmp_path / "t")), _SaveAt(4, old), CrashAt(17)]).fit(
            model, datamodule=data
        )
    model, data = build(seed=99)
    cb = TieredCheckpoint(_tiers(tmp_path / "t"))
    trainer(STEPS, [cb]).fit(model, datamodule=data, ckpt_path=old)
    assert cb.stats.restored_step is not None and cb.stats.restored_step >= 15
    assert_bitwise_equal(weights(model), reference)

    model, data = build(seed=99)  # nothing of ours newer than the file: Lightning restores it
    cb = TieredCheckpoint(_tiers(tmp_path / "empty"))
    trainer(STEPS, [cb]).fit(model, datamodule=data, ckpt_path=old)
    assert cb.stats.restored_step is None
    assert_bitwise_equal(weights(model), reference)
