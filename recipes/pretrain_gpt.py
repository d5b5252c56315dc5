"""Hydra recipe: a GPT with the resilience suite (``resilience=minimal|default|full``) and optional fault drills
(``drill=kill_rank|crash|hang|preempt|slow_rank|bit_flip``).

Data: synthetic tokens by default (no download); ``data.source=tokens data.path=train.bin`` for a nanoGPT-style
``uint16`` token file (``model.preset=gpt2`` for GPT-2 ids), ``data.source=text data.path=book.txt`` for a text file
read byte by byte (vocabulary 256).

Every attempt (each launcher restart) appends its figures to ``<run_dir>/report.jsonl`` and writes the end-of-run
``<run_dir>/resilience_report.json``; the process exits with the code a resilience callback asked for (hang,
preemption, straggler, SDC), so a launcher restarts the job when it should.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from lightning.pytorch import LightningDataModule, seed_everything
from omegaconf import DictConfig

from lightning_resilience import ResumableDataLoader
from lightning_resilience.config.registry import register_configs

from ._corpus import CorpusDataModule
from ._data import SyntheticTokenDataModule
from ._gpt import TinyGPT, gpt_preset
from ._runner import finish, fit

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
SYNTHETIC_SAMPLES, SYNTHETIC_VOCAB = 512, 256


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train once (one attempt) and return its report."""
    seed_everything(int(cfg.seed), workers=True)
    arch = {**gpt_preset(str(cfg.model.preset)), **dict(cfg.model.overrides), "max_steps": 10_000}
    data = data_module(cfg.data, vocab_size=int(arch["vocab_size"]), context=int(arch["seq_len"]), seed=int(cfg.seed))
    return fit(cfg, TinyGPT(**arch), data)


def data_module(data: DictConfig, *, vocab_size: int, context: int, seed: int) -> LightningDataModule:
    """The train data of ``data`` for a model of ``vocab_size`` tokens and a ``context``-token window."""
    source, seq_len = str(data.source), int(data.seq_len)
    if seq_len > context:
        raise ValueError(f"data.seq_len={seq_len} exceeds the model's context of {context} tokens (model.preset)")
    common: dict[str, Any] = dict(
        batch_size=int(data.batch_size), seq_len=seq_len, num_workers=int(data.num_workers),
        loader_cls=ResumableDataLoader,
    )  # fmt: skip
    samples = None if data.num_samples is None else int(data.num_samples)
    if source == "synthetic":
        if data.path is not None:
            raise ValueError("data.path is for data.source=tokens or text; synthetic data has no file")
        tokens = SYNTHETIC_VOCAB if data.vocab_size is None else int(data.vocab_size)
        if tokens > vocab_size:
            raise ValueError(f"data.vocab_size={tokens} exceeds the model's vocabulary of {vocab_size}")
        item_seed = seed if data.seed is None else int(data.seed)
        return SyntheticTokenDataModule(
            num_samples=samples or SYNTHETIC_SAMPLES, vocab_size=tokens, seed=item_seed, **common
        )
    for key in ("vocab_size", "seed"):
        if data[key] is not None:
            raise ValueError(f"data.{key} applies to synthetic data only (data.source={source}): leave it null")
    if data.path is None:
        raise ValueError(f"data.source={source} needs data.path (the file to train on)")
    return CorpusDataModule(str(data.path), source, vocab_size, num_samples=samples, **common)  # type: ignore[arg-type]


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="pretrain_gpt")
def main(cfg: DictConfig) -> None:
    finish(run(cfg))


if __name__ == "__main__":
    register_configs()
    main()
