"""Hydra recipe: fine-tune a sequence classifier on a TinyGPT backbone with the resilience suite and fault drills.

Start from a pre-trained backbone by exporting a ``pretrain_gpt`` step (``lightning-resilience ckpt export``) and
passing it as ``model.init_from``; otherwise the backbone starts from random weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from lightning.pytorch import seed_everything
from omegaconf import DictConfig, OmegaConf

from lightning_resilience import ResumableDataLoader
from lightning_resilience.config.registry import register_configs

from ._classifier import GPTClassifier
from ._data import SyntheticClassificationDataModule
from ._gpt import gpt_preset
from ._runner import finish, fit

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train once (one attempt) and return its report."""
    seed_everything(int(cfg.seed), workers=True)
    backbone = {**gpt_preset(str(cfg.model.preset)), "vocab_size": int(cfg.data.vocab_size)}
    backbone["seq_len"] = max(int(backbone["seq_len"]), int(cfg.data.seq_len))
    model = GPTClassifier(
        num_classes=int(cfg.data.num_classes),
        backbone=backbone,
        init_from=None if cfg.model.init_from is None else str(cfg.model.init_from),
        lr=float(cfg.model.lr),
    )
    data = SyntheticClassificationDataModule(**OmegaConf.to_container(cfg.data), loader_cls=ResumableDataLoader)  # type: ignore[arg-type]
    return fit(cfg, model, data)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="finetune_classifier")
def main(cfg: DictConfig) -> None:
    finish(run(cfg))


if __name__ == "__main__":
    register_configs()
    main()
