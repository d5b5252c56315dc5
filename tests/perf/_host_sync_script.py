"""One rank of the host-sync count: the ``pretrain_gpt`` recipe's model, data and ``resilience=<preset>`` callbacks
under Lightning DDP (launched by torchrun), a CSV logger, and :class:`tests._host_syncs.HostSyncCounter` first.

Usage: ``torchrun --nproc-per-node 2 -m tests.perf._host_sync_script <preset> <out_dir> <steps> [override ...]``;
each rank writes ``<out_dir>/syncs_rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf

from lightning_resilience.config.registry import register_configs
from lightning_resilience.lightning.suite import build_suite
from recipes._gpt import TinyGPT, gpt_preset
from recipes.pretrain_gpt import CONFIG_DIR, data_module
from tests._host_syncs import HostSyncCounter


def main(argv: list[str]) -> None:
    preset, out, steps, *extra = argv
    out_dir = Path(out)
    register_configs()
    overrides = [
        f"resilience={preset}",
        f"run_dir={out_dir / 'run'}",
        f"trainer.max_steps={steps}",
        "trainer.devices=2",
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
    counter = HostSyncCounter()
    trainer = Trainer(
        max_steps=int(cfg.trainer.max_steps),
        accelerator=str(cfg.trainer.accelerator),
        devices=2,
        strategy="ddp",
        log_every_n_steps=int(cfg.trainer.log_every_n_steps),
        deterministic=bool(cfg.trainer.deterministic),
        callbacks=[counter, *build_suite(cfg.resilience)],
        default_root_dir=str(cfg.run_dir),
        logger=CSVLogger(str(out_dir / "logs")),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=data)
    report = counter.report()
    report["sdc"] = OmegaConf.to_container(cfg.resilience.get("sdc", {}).get("config", {}))
    report["global_step"] = trainer.global_step
    (out_dir / f"syncs_rank{trainer.global_rank}.json").write_text(json.dumps(report, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
