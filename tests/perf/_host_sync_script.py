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
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf

from tests._host_syncs import HostSyncCounter
from tests.perf._recipe_rank import fit_recipe


def main(argv: list[str]) -> None:
    preset, out, steps, *extra = argv
    out_dir = Path(out)
    counter = HostSyncCounter()
    trainer, cfg = fit_recipe(
        preset, out_dir, int(steps), 2, [counter], list(extra), logger=CSVLogger(str(out_dir / "logs"))
    )
    report = counter.report()
    report["sdc"] = OmegaConf.to_container(cfg.resilience.get("sdc", {}).get("config", {}))
    report["global_step"] = trainer.global_step
    (out_dir / f"syncs_rank{trainer.global_rank}.json").write_text(json.dumps(report, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
