"""StragglerDetection inside a real Trainer: metrics are logged, and a 'stop' decision checkpoints through
TieredCheckpoint and stops training with the straggler exit code. Time comes from a fake clock advanced by the model,
so the slowdown is exact and the test never depends on the machine's speed."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_resilience import DecidedExit, ExitCode
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.lightning.callbacks.policy import ResiliencePolicy
from lightning_resilience.lightning.callbacks.straggler import StragglerDetection
from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint
from lightning_resilience.policy import Event, PolicyConfig
from lightning_resilience.straggler.config import StragglerConfig, StragglerLevelConfig

STRAGGLER_EXIT_CODE = ExitCode.STRAGGLER

pytestmark = pytest.mark.timeout(120)

_NOW = [0.0]


def fake_clock() -> float:
    """Module-level, so the callback that holds it stays picklable."""
    return _NOW[0]


class SlowingModel(LightningModule):
    """Each training step costs 0.1 s of fake time, ``factor`` x that from ``onset`` on."""

    def __init__(self, onset: int, factor: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.onset, self.factor = onset, factor

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _NOW[0] += 0.1 * (self.factor if self.global_step >= self.onset else 1.0)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=4)


def _trainer(callbacks: list, max_steps: int) -> Trainer:
    return Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=any(isinstance(cb, Checkpoint) for cb in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )


LADDER = [
    StragglerLevelConfig(action="alert", slowdown=1.2, persist_steps=2),
    StragglerLevelConfig(action="stop", slowdown=1.3, persist_steps=3),
]


def test_stop_decision_checkpoints_and_stops_with_exit_code(tmp_path: Path) -> None:
    _NOW[0] = 0.0
    onset = 40
    cb = StragglerDetection(StragglerConfig(warmup_steps=2, sections=["compute", "forward"], levels=LADDER),
                            clock=fake_clock)  # fmt: skip
    pickle.loads(pickle.dumps(cb))  # ddp_spawn pickles callbacks
    local = LocalTier(tmp_path / "ckpt", every_n_steps=1000, keep=2)
    ckpt = TieredCheckpoint(tiers=[MemoryTier(every_n_steps=1, keep=2), local], resume="never")
    trainer = _trainer([ckpt, cb], max_steps=200)
    with pytest.raises(DecidedExit) as ended:  # the end of fit ends the process with the straggler code
        trainer.fit(SlowingModel(onset=onset, factor=1.5))
    assert ended.value.code == STRAGGLER_EXIT_CODE

    assert cb.exit_code == STRAGGLER_EXIT_CODE
    cadence = StragglerConfig().gather_every_n_steps  # reported at the next exchange, acted on one step later
    assert cb.stopped_at_step is not None and onset < cb.stopped_at_step <= onset + 12 + cadence + 1
    assert trainer.global_step == cb.stopped_at_step < 200
    assert cb.checkpointed_at_stop and cb.stopped_at_step in local.list_steps()
    detector = cb.detector
    assert detector is not None and detector.mode == "individual"
    assert {v.section for v in detector.verdicts} <= {"compute", "forward"} and detector.verdicts
    assert [d.action.value for d in detector.decisions if d.verdict.section == "compute"] == [
        "alert",
        "checkpoint_and_stop",
    ]
    metrics = cb.last_metrics
    assert metrics["resilience/straggler/verdicts"] >= 1
    assert metrics["resilience/straggler/compute/max_score"] > 1.3
    assert metrics["resilience/straggler/alerts"] >= 1
    assert "resilience/straggler/forward/score/rank_0" in metrics
    assert "stopped at step" in cb.summary() and f"exit code {STRAGGLER_EXIT_CODE}" in cb.summary()
    report = cb.report()
    assert report["exit_code"] == STRAGGLER_EXIT_CODE and report["verdicts"]
    assert cb.state_dict()["decisions"][-1]["action"] == "checkpoint_and_stop"


def test_steady_run_trains_to_the_end_without_decisions() -> None:
    _NOW[0] = 0.0
    cb = StragglerDetection(StragglerConfig(warmup_steps=2, levels=LADDER), clock=fake_clock)
    trainer = _trainer([cb], max_steps=60)
    trainer.fit(SlowingModel(onset=10**9, factor=1.0))
    assert trainer.global_step == 60 and cb.exit_code is None
    assert cb.detector is not None and cb.detector.verdicts == [] and cb.detector.gathers == (60 - 2) // 10
    assert cb.last_metrics["resilience/straggler/verdicts"] == 0


class RecordEnd(Callback):
    """Writes what each rank saw at the end of fit (spawned ranks do not hand callbacks back to the parent)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        cb = next(c for c in trainer.callbacks if isinstance(c, StragglerDetection))  # type: ignore[attr-defined]
        det = cb.detector
        assert det is not None
        record = {
            "global_step": trainer.global_step,
            "exit_code": cb.exit_code,
            "stopped_at": cb.stopped_at_step,
            "mode": det.mode,
            "verdict_ranks": [v.rank for v in det.verdicts],
            "decisions": [d.to_dict() for d in det.decisions],
            "metrics": cb.last_metrics,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


class RankSlowingModel(SlowingModel):
    """Only rank ``slow_rank`` slows down."""

    def __init__(self, onset: int, factor: float, slow_rank: int) -> None:
        super().__init__(onset, factor)
        self.slow_rank = slow_rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        slow = self.global_rank == self.slow_rank and self.global_step >= self.onset
        _NOW[0] += 0.1 * (self.factor if slow else 1.0)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)


def test_ddp_spawn_two_ranks_name_the_slow_one_and_both_stop(tmp_path: Path) -> None:
    cb = StragglerDetection(StragglerConfig(warmup_steps=2, levels=LADDER), clock=fake_clock)
    trainer = Trainer(
        max_steps=100,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        # spawned workers hand no exit code back to this process: they return, and RecordEnd reports the code
        callbacks=[cb, RecordEnd(tmp_path), ResiliencePolicy(PolicyConfig(exit_after_fit=False))],
    )
    trainer.fit(RankSlowingModel(onset=30, factor=1.5, slow_rank=1))
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # rank 0 scores both ranks' timings and decides; the policy's next agreement stops both at the same step
    assert all(r["mode"] == "relative" for r in records)
    assert records[0]["verdict_ranks"] == [1] and records[1]["verdict_ranks"] == [] and records[1]["decisions"] == []
    assert {r["exit_code"] for r in records} == {STRAGGLER_EXIT_CODE}
    steps = {r["global_step"] for r in records}
    cadence = StragglerConfig().gather_every_n_steps
    # the scoring process runs on real time beside steps on a fake clock (no step waits for it): on a loaded machine
    # its verdict may come with the next exchange rather than this one
    assert len(steps) == 1 and 30 < steps.pop() <= 30 + 12 + 2 * cadence + 1
    assert records[0]["metrics"]["resilience/straggler/compute/slowest_rank"] == 1


def test_a_decision_taken_while_the_next_exchange_is_scored_is_logged_and_posted() -> None:
    """Rank 0's scorer may always have the next exchange in flight when one lands (a loaded machine, thousands of
    ranks): the decisions that land are still logged and a stop is still posted to the policy, at once."""
    from types import SimpleNamespace
    from unittest.mock import PropertyMock, patch

    from lightning_resilience.straggler import StragglerDetector
    from lightning_resilience.straggler.config import StragglerConfig as Config
    from tests.straggler._sim import FakeClock

    config = Config(warmup_steps=2, levels=LADDER)
    clock = FakeClock()

    def gather(payload: dict[str, Any]) -> list[dict[str, Any]]:  # rank 1 computes 1.5x longer from step 30
        slow = [1.5 if step >= 30 else 1.0 for step in payload["steps"]]
        times = [{k: v * f if k in ("step", "compute", "forward") else v for k, v in row.items()}
                 for row, f in zip(payload["times"], slow)]  # fmt: skip
        return [payload, payload | {"rank": 1, "times": times}]

    posted: list[Any] = []
    callback = StragglerDetection(config, clock=clock)
    callback.detector = StragglerDetector(config, rank=0, world_size=2, gather=gather, clock=clock)
    trainer = SimpleNamespace(global_step=0, global_rank=0, loggers=[])
    callback._trainer = trainer  # type: ignore[assignment]
    callback._suite = SimpleNamespace(post=lambda _trainer, verdict: posted.append(verdict))  # type: ignore[assignment]
    with patch.object(StragglerDetector, "scoring", new_callable=PropertyMock, return_value=True):
        for step in range(1, 80):
            trainer.global_step = step
            callback.detector.start_step()
            with callback.detector.section("forward"):
                clock.advance(0.1)
            callback.finish_step(step)
            if posted:
                break
    assert posted and posted[0].event is Event.STRAGGLER and "rank 1" in posted[0].detail
    assert 30 < posted[0].step <= 60
    assert callback.last_metrics["resilience/straggler/compute/slowest_rank"] == 1


class RecordParts(Callback):
    """After StragglerDetection's fit start: notes every part of the step its detector is asked to time."""

    def __init__(self) -> None:
        self.parts: set[str] = set()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        cb = next(c for c in trainer.callbacks if isinstance(c, StragglerDetection))  # type: ignore[attr-defined]
        det = cb.detector
        assert det is not None
        begin = det.begin

        def noted(name: str) -> None:
            self.parts.add(name)
            begin(name)

        det.begin = noted  # type: ignore[method-assign]


@pytest.mark.parametrize(("sections", "timed"), [(None, set()), (["compute", "backward"], {"backward"})])
def test_only_the_tested_parts_of_the_step_are_timed(sections: list[str] | None, timed: set[str]) -> None:
    _NOW[0] = 0.0
    cb = StragglerDetection(StragglerConfig(warmup_steps=2, sections=sections), clock=fake_clock)
    parts = RecordParts()
    _trainer([cb, parts], max_steps=12).fit(SlowingModel(onset=10**9, factor=1.0))
    assert parts.parts == timed  # forward, backward and optimizer only where tested: the others are never sent
    assert cb.detector is not None and cb.detector.gathers == 1
