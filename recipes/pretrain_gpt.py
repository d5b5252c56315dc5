"""Hydra recipe: a small GPT on synthetic tokens with per-step tiered checkpointing and optional fault drills.

Every attempt (each launcher restart) appends its figures to ``<run_dir>/report.jsonl``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from omegaconf import DictConfig, OmegaConf

from lightning_resilience import CheckpointConfig, ResilientDDPStrategy, ResumableDataLoader, TieredCheckpoint
from recipes._data import SyntheticTokenDataModule
from recipes._gpt import TinyGPT, gpt_preset

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


def attempt_number() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class FaultDrill(Callback):
    """Injects one fault at a chosen (rank, step, attempt): a SIGKILL or an exception."""

    def __init__(self, kind: str, step: int, rank: int, attempt: int) -> None:
        if kind not in ("none", "kill", "crash"):
            raise ValueError(f"drill.kind must be none, kill or crash, got {kind!r}")
        self.kind, self.step, self.rank, self.attempt = kind, step, rank, attempt

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self.kind == "none" or trainer.global_step != self.step:
            return
        if trainer.global_rank != self.rank or attempt_number() != self.attempt:
            return
        print(f"[drill] rank {self.rank}: injecting {self.kind} at step {self.step}", flush=True)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"drill: injected crash at step {self.step}")


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


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train once (one attempt) and return its report."""
    seed_everything(int(cfg.seed), workers=True)
    model = TinyGPT(**{**gpt_preset(str(cfg.model.preset)), **dict(cfg.model.overrides), "max_steps": 10_000})
    data = SyntheticTokenDataModule(**OmegaConf.to_container(cfg.data), loader_cls=ResumableDataLoader)  # type: ignore[arg-type]
    ckpt_cfg = CheckpointConfig(
        resume=str(cfg.checkpoint.resume),
        if_none_valid=cfg.checkpoint.if_none_valid,
        on_persist_error=cfg.checkpoint.on_persist_error,
    )
    tiered = TieredCheckpoint(tiers=[instantiate(t) for t in cfg.checkpoint.tiers], config=ckpt_cfg)
    tracker = LossTracker()
    tc = cfg.trainer
    trainer = Trainer(
        max_steps=int(tc.max_steps),
        accelerator=str(tc.accelerator),
        devices=tc.devices,
        strategy=build_strategy(str(tc.strategy)),
        log_every_n_steps=int(tc.log_every_n_steps),
        deterministic=bool(tc.deterministic),
        callbacks=[tiered, FaultDrill(**cfg.drill), tracker],
        default_root_dir=str(cfg.run_dir),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        logger=False,
    )
    started = time.perf_counter()
    trainer.fit(model, datamodule=data)
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
    }
    if trainer.is_global_zero:
        print(tiered.summary(), flush=True)
        run_dir = Path(str(cfg.run_dir))
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "report.jsonl", "a") as f:
            f.write(json.dumps(report) + "\n")
    return report


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="pretrain_gpt")
def main(cfg: DictConfig) -> None:
    run(cfg)
    if torch.distributed.is_initialized():
        # an explicit teardown: left to interpreter exit, gloo's threads can abort the process (SIGABRT)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
