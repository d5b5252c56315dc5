"""The job of ``benchmarks.rollback``: the drill's user script (``tests/drills/_rollback_script.py``: the default
preset, ``DataLoader(shuffle=True)``, DDP under torchrun) with a NaN sample that fires in the first attempt only,
Hydra overrides of the preset from the command line, and a callback that appends the wall-clock end of every
training step to ``<run_dir>/times/attempt<N>_rank<R>.jsonl``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader

from lightning_resilience import DecidedExit
from lightning_resilience.config.registry import register_configs
from lightning_resilience.lightning.suite import build_suite
from tests.drills._rollback_script import PoisonedPoints

ROOT = Path(__file__).resolve().parents[1]
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class _Times(Callback):
    """Appends (attempt, step, wall time) at the end of every training step; runs before the suite decides."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"attempt": ATTEMPT, "step": trainer.global_step, "t": time.time()}) + "\n")


class _Mlp(LightningModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))  # fmt: skip

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> int:
    run_dir, steps, poison, hidden = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    seed_everything(1234)
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("pretrain_gpt", overrides=[f"run_dir={run_dir}", "resilience=default", *sys.argv[5:]])
    dataset = PoisonedPoints(poison if ATTEMPT == 0 else -1)  # a transient fault: the restart does not meet it
    trainer = Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp",
        callbacks=[
            _Times(run_dir / "times" / f"attempt{ATTEMPT}_rank{os.environ.get('RANK', '0')}.jsonl"),
            *build_suite(cfg.resilience),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
    )
    try:
        trainer.fit(_Mlp(hidden), DataLoader(dataset, batch_size=8, shuffle=True))
    except DecidedExit as decided:
        return int(decided.exit_code)
    return 0


if __name__ == "__main__":
    code = main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.exit(code)
