"""Hydra recipe: a small GPT on synthetic tokens with the resilience suite (``resilience=minimal|default|full``)
and optional fault drills (``drill=kill_rank|crash|hang|preempt|slow_rank|bit_flip``).

Every attempt (each launcher restart) appends its figures to ``<run_dir>/report.jsonl`` and writes the end-of-run
``<run_dir>/resilience_report.json``; the process exits with the code a resilience callback asked for (hang,
preemption, straggler, SDC), so a launcher restarts the job when it should.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from lightning.pytorch import seed_everything
from omegaconf import DictConfig, OmegaConf

from lightning_resilience import ResumableDataLoader
from lightning_resilience.config.registry import register_configs

from ._data import SyntheticTokenDataModule
from ._gpt import TinyGPT, gpt_preset
from ._runner import finish, fit

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train once (one attempt) and return its report."""
    seed_everything(int(cfg.seed), workers=True)
    model = TinyGPT(**{**gpt_preset(str(cfg.model.preset)), **dict(cfg.model.overrides), "max_steps": 10_000})
    data = SyntheticTokenDataModule(**OmegaConf.to_container(cfg.data), loader_cls=ResumableDataLoader)  # type: ignore[arg-type]
    return fit(cfg, model, data)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="pretrain_gpt")
def main(cfg: DictConfig) -> None:
    finish(run(cfg))


if __name__ == "__main__":
    register_configs()
    main()
