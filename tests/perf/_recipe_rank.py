"""One rank of the ``pretrain_gpt`` recipe under torchrun, for the counting tests of ``tests/perf``: its model, data
and ``resilience=<preset>`` callbacks under Lightning DDP, with the caller's callbacks first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch import Callback, Trainer, seed_everything
from omegaconf import DictConfig

from lightning_resilience.config.registry import register_configs
from lightning_resilience.lightning.suite import build_suite
from recipes._gpt import TinyGPT, gpt_preset
from recipes.pretrain_gpt import CONFIG_DIR, data_module


def fit_recipe(
    preset: str, out_dir: Path, steps: int, world: int, first: list[Callback], extra: list[str], **trainer: Any
) -> tuple[Trainer, DictConfig]:
    """Compose the recipe with ``resilience=<preset>`` on ``world`` DDP ranks and fit it; returns the trainer."""
    register_configs()
    overrides = [
        f"resilience={preset}",
        f"run_dir={out_dir / 'run'}",
        f"trainer.max_steps={steps}",
        f"trainer.devices={world}",
        "trainer.strategy=ddp",
        *extra,
    ]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("pretrain_gpt", overrides=overrides)
    torch.set_num_threads(1)
    seed_everything(int(cfg.seed), workers=True)
    arch = {**gpt_preset(str(cfg.model.preset)), **dict(cfg.model.overrides), "max_steps": 10_000}
    model = TinyGPT(**arch)
    data = data_module(cfg.data, vocab_size=int(arch["vocab_size"]), context=int(arch["seq_len"]), seed=int(cfg.seed))
    fit = Trainer(
        max_steps=int(cfg.trainer.max_steps),
        accelerator=str(cfg.trainer.accelerator),
        devices=world,
        strategy="ddp",
        log_every_n_steps=int(cfg.trainer.log_every_n_steps),
        deterministic=bool(cfg.trainer.deterministic),
        callbacks=[*first, *build_suite(cfg.resilience)],
        default_root_dir=str(cfg.run_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **trainer,
    )
    fit.fit(model, datamodule=data)
    return fit, cfg
