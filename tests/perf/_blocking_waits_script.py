"""One rank of the blocking-wait count: the ``pretrain_gpt`` recipe's model, data and ``resilience=<preset>``
callbacks under Lightning DDP (launched by torchrun), with the side groups' fault hook recording every agreement the
suite enters, on which thread and at which step.

Usage: ``torchrun --nproc-per-node N -m tests.perf._blocking_waits_script <preset> <out_dir> <steps> [override ...]``;
each rank writes ``<out_dir>/waits_rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from omegaconf import OmegaConf

from lightning_resilience.collective import set_fault_hook
from lightning_resilience.lightning.coordination import Suite
from tests.perf._recipe_rank import fit_recipe


class WaitCounter(Callback):
    """Every side-group operation of the suite, keyed by the optimizer step it happened in (the ``global_step`` at the
    batch start), split by thread: the training thread's block it; another thread's do not."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.main = threading.get_ident()
        self.ops: list[tuple[int | None, str, bool]] = []
        set_fault_hook(self._hook)

    def _hook(self, op: str, rank: int, step: int | None) -> None:
        self.ops.append((self.step, op, threading.get_ident() == self.main))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.step = trainer.global_step

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.step = None  # the end of training (a final persist, the settle) is not a step


def main(argv: list[str]) -> None:
    preset, out, steps, *extra = argv
    out_dir = Path(out)
    counter = WaitCounter()
    trainer, cfg = fit_recipe(preset, out_dir, int(steps), int(os.environ["WORLD_SIZE"]), [counter], list(extra))
    suite = Suite.of(trainer)
    assert suite.driver is not None
    stats = suite.driver.agreement.stats
    report = {
        "ops": counter.ops,
        "global_step": trainer.global_step,
        "rounds": stats.rounds,
        "late_results": stats.waits,
        "waited_s": stats.waited_seconds,
        "fields": suite.driver.fields,
        "sdc": OmegaConf.to_container(cfg.resilience.get("sdc", {}).get("config", {})),
    }
    (out_dir / f"waits_rank{trainer.global_rank}.json").write_text(json.dumps(report, indent=1))
    set_fault_hook(None)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
