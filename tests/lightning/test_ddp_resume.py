"""Exact resume under Lightning DDP: 2 CPU processes on gloo, launched by spawn.

Lightning runs ``fit`` in spawned workers, so everything the test checks comes back through files in ``tmp_path``:
each rank saves its final weights (``torch.save``) and a small JSON report when training ends.
"""

from __future__ import annotations

import json
import pickle
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_resilience import LocalTier, MemoryTier, ResilientDDPStrategy, Tier, TieredCheckpoint
from tests.lightning._training import (
    CrashAt,
    SettlePersists,
    assert_bitwise_equal,
    build,
    drain_persists,
    trainer,
    weights,
)

STEPS = 20  # 6 batches per epoch and rank (48 samples, batch 4, 2 ranks): the run crosses 3 epoch boundaries
CRASH_AT = 13
WORLD_SIZE = 2
DRAIN_TIMEOUT = timedelta(seconds=30)


class ReportAtEnd(Callback):
    """Writes this rank's final weights and what the tiered checkpoint restored, for the parent process to read."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        rank = trainer.global_rank
        torch.save(weights(pl_module), self.out / f"weights_rank{rank}.pt")
        tiered = [c for c in trainer.callbacks if isinstance(c, TieredCheckpoint)]
        stats = tiered[0].stats if tiered else None
        report = {
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
            "restored_step": stats.restored_step if stats else None,
            "restored_from": stats.restored_from if stats else None,
        }
        (self.out / f"report_rank{rank}.json").write_text(json.dumps(report))


class DrainThenCrashAt(CrashAt):
    """Crashes at ``step`` on every rank once every rank's in-flight persist has committed.

    The spawn launcher terminates the surviving workers as soon as one raises, so without the drain which steps are
    on disk would depend on thread timing; the test wants to know exactly which step the resume must pick.
    """

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            drain_persists(trainer, DRAIN_TIMEOUT)
            trainer.strategy.barrier("drain_then_crash")
        super().on_train_batch_start(trainer, pl_module, *args)


class SaveCheckpointAt(Callback):
    """Calls ``Trainer.save_checkpoint(path)`` on every rank at the end of one global step."""

    def __init__(self, step: int, path: Path) -> None:
        self.step = step
        self.path = path

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _ddp_trainer(callbacks: list[Callback]) -> Trainer:
    return trainer(STEPS, callbacks, devices=WORLD_SIZE, strategy=ResilientDDPStrategy(start_method="spawn"))


def _results(out: Path) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, Any]]]:
    states = [torch.load(out / f"weights_rank{r}.pt", weights_only=True) for r in range(WORLD_SIZE)]
    reports = [json.loads((out / f"report_rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    return states, reports


def _scramble(model: torch.nn.Module) -> None:
    """Overwrite every weight from a private generator: a restarted process does not start where the crash left off,
    and the global RNG (which the resumed run must continue exactly) is left untouched."""
    gen = torch.Generator().manual_seed(12345)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _tiers(root: Path, every_n_steps: int = 5) -> list[Tier]:
    return [MemoryTier(every_n_steps=1, keep=2), LocalTier(root, every_n_steps=every_n_steps, keep=2)]


def test_tiered_checkpoint_survives_pickling_for_spawn(tmp_path: Path) -> None:
    # start_method="spawn" (and strategy="ddp_spawn") pickle the Trainer with its callbacks into every worker
    cb = pickle.loads(pickle.dumps(TieredCheckpoint(_tiers(tmp_path))))
    assert [type(t) for t in cb.tiers] == [MemoryTier, LocalTier]
    assert cb.tiers[0].list_steps() == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("ddp_reference")
    model, data = build()
    _ddp_trainer([ReportAtEnd(out)]).fit(model, datamodule=data)
    states, reports = _results(out)
    assert [r["global_step"] for r in reports] == [STEPS] * WORLD_SIZE
    assert [r["world_size"] for r in reports] == [WORLD_SIZE] * WORLD_SIZE
    assert_bitwise_equal(states[0], states[1])  # DDP keeps the replicas identical
    return states


@pytest.mark.parametrize(
    ("every_n_steps", "restored_step"),
    [(5, 10), (6, 12)],  # 6 batches per epoch and rank: step 12 is the last batch of an epoch
    ids=["mid-epoch", "epoch-end"],
)
def test_ddp_resume_after_crash_is_bitwise_exact(
    tmp_path: Path, reference: list[dict[str, torch.Tensor]], every_n_steps: int, restored_step: int
) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    model, data = build()
    with pytest.raises(Exception, match="injected crash"):  # re-raised in the parent from the spawned workers
        _ddp_trainer(
            [
                TieredCheckpoint(_tiers(ckpt, every_n_steps)),
                SettlePersists(every_n_steps, DRAIN_TIMEOUT),
                DrainThenCrashAt(CRASH_AT),
            ]
        ).fit(model, datamodule=data)
    # every rank committed its shard of both persisted steps (the in-memory tier died with the workers)
    for step in (restored_step - every_n_steps, restored_step):
        assert sorted(p.name for p in (ckpt / f"step_{step:012d}").iterdir()) == ["rank_00000", "rank_00001"]

    model, data = build()  # same job seed: Lightning's DistributedSampler shuffles with PL_GLOBAL_SEED
    _scramble(model)
    _ddp_trainer([TieredCheckpoint(_tiers(ckpt, every_n_steps)), ReportAtEnd(out)]).fit(model, datamodule=data)

    states, reports = _results(out)
    for rank in range(WORLD_SIZE):
        assert reports[rank]["restored_step"] == restored_step
        assert reports[rank]["restored_from"] == "local"
        assert reports[rank]["global_step"] == STEPS
        assert_bitwise_equal(states[rank], reference[rank])


def test_save_checkpoint_writes_one_shard_per_rank_and_fit_resumes_from_it(
    tmp_path: Path, reference: list[dict[str, torch.Tensor]]
) -> None:
    path, out = tmp_path / "manual.ckpt", tmp_path / "out"
    out.mkdir()
    # the callback's state carries each rank's RNG streams, so it must be attached when saving and when loading
    model, data = build()
    with pytest.raises(Exception, match="injected crash"):
        _ddp_trainer(
            [TieredCheckpoint([MemoryTier()], resume="never"), SaveCheckpointAt(10, path), CrashAt(CRASH_AT)]
        ).fit(model, datamodule=data)
    assert sorted(p.name for p in path.iterdir()) == ["rank_00000", "rank_00001"]  # no temporaries left behind
    for rank in range(WORLD_SIZE):
        manifest = json.loads((path / f"rank_{rank:05d}" / "manifest.json").read_text())
        assert (manifest["step"], manifest["rank"], manifest["world_size"]) == (10, rank, WORLD_SIZE)

    model, data = build()
    _scramble(model)
    _ddp_trainer([TieredCheckpoint([MemoryTier()]), ReportAtEnd(out)]).fit(model, datamodule=data, ckpt_path=path)

    states, reports = _results(out)
    for rank in range(WORLD_SIZE):
        assert reports[rank]["restored_step"] is None  # an explicit ckpt_path wins over automatic resume
        assert reports[rank]["global_step"] == STEPS
        assert_bitwise_equal(states[rank], reference[rank])
