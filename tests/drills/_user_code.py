"""The user's side of the user-path drills, with no import of lightning_resilience: the model and data a new user
writes, and the drill plumbing (one injected fault, a per-attempt report, the final weights) that any script of the
harness shares (``tests/drills/_harness.py``: ``--run-dir --steps --workers --fault --fault-step --fault-rank
--launch --fault-launch``).

A fault fires on rank R as step K + 1 starts, once every callback (the checkpoint callback runs last) is done with
step K, in launch ``L`` (``--fault-launch``) on its first torchrun attempt only:

* ``sigkill``: rank R SIGKILLs itself (no clean-up, no flush: a lost process);
* ``sigkill-persist``: rank R's local-disk write of step K stalls half-way and rank R is SIGKILLed while it is in
  flight (K must be a persist step of the local tier; the stall is armed by the script that owns the tier);
* ``sigterm-rank``: rank R receives SIGTERM (a preemption notice on one rank);
* ``sigterm-launcher``: rank R sends SIGTERM to the torchrun launcher (the scheduler ends the job); the harness
  relaunches it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import Dataset

FAULTS = ("none", "sigkill", "sigkill-persist", "sigterm-rank", "sigterm-launcher")
START_LIMIT_S = 20.0  # a submitted persist reaches the disk within milliseconds


# ---------------------------------------------------------------------------------------------- the user's code
class AugmentedPoints(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed points of a noisy linear task; every item gets fresh random jitter (drawn in the worker that loads it)."""

    def __init__(self, n: int = 400) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[idx] + 0.05 * torch.randn(16), self.y[idx]


class Regressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        pred = self.net(x + 0.01 * torch.randn_like(x))
        return nn.functional.mse_loss(pred, y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# ------------------------------------------------------------------------------------------------ drill plumbing
class Fault(Callback):
    """Injects one fault on one rank (see the module docstring)."""

    def __init__(self, kind: str, step: int, rank: int) -> None:
        self.kind, self.step, self.rank = kind, step, rank
        self.in_flight = threading.Event()
        """Set by an armed persist stall once the write of ``step`` is half-way through."""

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if self.kind == "sigterm-rank":
            print(f"DRILL: rank {self.rank} SIGTERM after step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.kind == "sigterm-launcher":
            print(f"DRILL: rank {self.rank} SIGTERM to the launcher after step {self.step}", flush=True)
            os.kill(os.getppid(), signal.SIGTERM)
        elif self.kind in ("sigkill", "sigkill-persist"):
            # the persist of step K runs on the engine's thread: wait until it is half-way through the shard
            if self.kind == "sigkill-persist" and not self.in_flight.wait(START_LIMIT_S):
                raise RuntimeError(f"the persist of step {self.step} never started; cannot kill during it")
            print(f"DRILL: rank {self.rank} SIGKILL after step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class Report(Callback):
    """Writes what this attempt restored and where it ended, as a small JSON file.

    ``restored`` gives the restored step (None: started fresh); by default a run that starts past step 0 restored it.
    """

    def __init__(self, path: Path, report: dict[str, Any], restored: Callable[[Trainer], int | None] | None = None):
        self.path, self.report = path, report
        self.restored = restored or (lambda trainer: trainer.global_step or None)

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, sort_keys=True))
        os.replace(tmp, self.path)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.report.update(restored_step=self.restored(trainer), start_step=trainer.global_step)
        self._write()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.report["final_step"] = trainer.global_step
        self._write()


def parse(argv: list[str], description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-step", type=int, default=0)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--launch", type=int, default=0, help="which launch of the job this is (the harness counts)")
    parser.add_argument("--fault-launch", type=int, default=0)
    return parser.parse_args(argv)


def drill_callbacks(args: argparse.Namespace, restored: Callable[[Trainer], int | None] | None = None) -> list[Any]:
    """This attempt's report, and the fault when this launch's first attempt is the one to hit."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    tag = f"launch{args.launch}_attempt{attempt}_rank{int(os.environ.get('RANK', '0'))}"
    out: list[Any] = [Report(args.run_dir / "reports" / f"{tag}.json", {"launch": args.launch}, restored)]
    if args.fault != "none" and attempt == 0 and args.launch == args.fault_launch:
        out.append(Fault(args.fault, args.fault_step, args.fault_rank))
    return out


def save_weights(trainer: Trainer, model: torch.nn.Module, args: argparse.Namespace) -> None:
    """Rank 0 of the attempt that reached ``--steps`` writes the final weights."""
    if trainer.global_rank == 0 and trainer.global_step == args.steps:
        tmp = args.run_dir / "weights.tmp"
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, tmp)
        os.replace(tmp, args.run_dir / "weights.pt")
