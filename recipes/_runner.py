"""Fit a recipe's model and data with the resilience suite of its config, and report what happened.

Every attempt (each launcher restart) appends its figures to ``<run_dir>/report.jsonl``; the full end-of-run report
(``<run_dir>/resilience_report.json``, the table, plots) comes from the suite's ``ResilienceReportCallback``. The
process ends with the code the suite decided (:func:`finish`), after the process group is torn down.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from omegaconf import DictConfig

from lightning_resilience import ResilientDDPStrategy
from lightning_resilience.exit_codes import DecidedExit
from lightning_resilience.lightning.coordination import Suite
from lightning_resilience.lightning.suite import build_suite

from ._resilience import attempt_number, drill_callbacks

__all__ = ["LossTracker", "build_strategy", "finish", "fit"]


class LossTracker(Callback):
    def __init__(self) -> None:
        self.last_loss: float | None = None
        self.step_seconds: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, *args: Any) -> None:
        self.step_seconds.append(time.perf_counter() - self._t0)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.last_loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else None


def build_strategy(name: str) -> Any:
    if name == "resilient_ddp":
        return ResilientDDPStrategy()
    return name


def fit(cfg: DictConfig, model: LightningModule, data: LightningDataModule) -> dict[str, Any]:
    """Train once (one attempt) with ``cfg.resilience`` and ``cfg.drill``; return this attempt's report."""
    callbacks = build_suite(cfg.resilience)
    tracker = LossTracker()
    tc = cfg.trainer
    trainer = Trainer(
        max_steps=int(tc.max_steps),
        accelerator=str(tc.accelerator),
        devices=tc.devices,
        strategy=build_strategy(str(tc.strategy)),
        log_every_n_steps=int(tc.log_every_n_steps),
        deterministic=bool(tc.deterministic),
        # drills first: a slow rank's wait falls inside the step the straggler detector times
        callbacks=[*drill_callbacks(cfg.drill), *callbacks, tracker],
        default_root_dir=str(cfg.run_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        logger=False,
    )
    started = time.perf_counter()
    try:
        trainer.fit(model, datamodule=data)
    except DecidedExit:
        pass  # the code is the suite's: this attempt's figures are written first, then finish() exits with it
    suite = Suite.of(trainer)
    tiered = suite.checkpoint
    if tiered is None or tiered.manager is None:
        raise ValueError("the recipe needs resilience.checkpoint (e.g. resilience/checkpoint=local)")
    stats = tiered.stats
    step_times = sorted(tracker.step_seconds[1:]) or [0.0]
    report = {
        "attempt": attempt_number(),
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "final_step": trainer.global_step,
        "final_loss": tracker.last_loss,
        "wall_seconds": time.perf_counter() - started,
        "median_step_ms": step_times[len(step_times) // 2] * 1e3,
        "snapshots": stats.captures,
        "state_mib": stats.state_bytes / 2**20,
        "blocking_ms_mean": stats.capture_seconds_mean * 1e3,
        "blocking_ms_max": stats.capture_seconds_max * 1e3,
        "tiers": {n: vars(t) for n, t in stats.tiers.items()},
        "restored_step": stats.restored_step,
        "restored_from": stats.restored_from,
        "restore_ms": stats.restore_seconds * 1e3,
        "skipped_corrupt": stats.skipped_corrupt,
        "discarded_suspect": tiered.discarded_suspect,
        "exit_code": int(suite.exit_code),
    }
    if trainer.is_global_zero:
        print(tiered.summary(), flush=True)
        for member in [*suite.reporters, suite]:
            print(member.summary(), flush=True)
        run_dir = Path(str(cfg.run_dir))
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "report.jsonl", "a") as f:
            f.write(json.dumps(report) + "\n")
    return report


def finish(report: dict[str, Any]) -> None:
    """End the process the way a launcher expects: process group torn down, the resilience exit code."""
    if torch.distributed.is_initialized():
        # an explicit teardown: left to interpreter exit, gloo's threads can abort the process (SIGABRT)
        torch.distributed.destroy_process_group()
    if report["exit_code"]:
        raise SystemExit(report["exit_code"])
