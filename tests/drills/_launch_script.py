"""Launcher drill workload: a plain Lightning script (a small MLP, ``DataLoader(shuffle=True)``, DDP on 2 CPU ranks)
with tiered checkpoints and fault tolerance, and faults scheduled per attempt.

Run by ``tests/drills/test_launch.py`` under ``lightning-resilience launch`` (or plain torchrun)::

    lightning-resilience launch --nproc-per-node 2 --max-restarts 5 --master-port PORT --run-dir RUN \\
        tests/drills/_launch_script.py --run-dir RUN --steps 24 --fault 0:sigkill:1:7 --fault 1:sigterm:0:13

``--fault ATTEMPT:KIND:RANK:STEP`` (repeatable; ATTEMPT ``*`` is every attempt) injects on that rank and attempt:

* ``sigkill``: SIGKILLs itself once step STEP is done (at the start of step STEP + 1);
* ``exception``: raises once step STEP is done;
* ``sigterm``: sends itself SIGTERM (a preemption notice) at the start of step STEP + 1;
* ``hang``: spins in a Python loop at the start of step STEP + 1 (the watchdog ends it with exit 86).

``--step-time S`` adds S seconds of "compute" to every step (a job long enough to be signalled mid-run).

Before a fault the faulty rank waits for its persist in flight, so what was committed does not depend on how loaded
the machine is. Each attempt of each rank writes ``RUN/reports/attempt<N>_rank<R>.json``. The process ends with the
suite's decided code (``FaultTolerance.exit_code``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_resilience import DecidedExit, LocalTier, MemoryTier, ResilientDDPStrategy, Suite, TieredCheckpoint
from lightning_resilience.ft.config import FaultToleranceConfig
from lightning_resilience.ft.restart import current_attempt
from lightning_resilience.lightning.callbacks.fault_tolerance import FaultTolerance

PERSIST_EVERY = 4
RUNAWAY_S = 120.0  # an injected hang ends by itself after this long, should the watchdog fail to end it
KINDS = ("sigkill", "exception", "sigterm", "hang")


class MLP(LightningModule):
    def __init__(self, step_time: float = 0.0) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.step_time = step_time

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.step_time:
            time.sleep(self.step_time)  # stands for compute; nothing waits on it
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Faults(Callback):
    """Injects this rank's faults of this attempt (see the module docstring)."""

    def __init__(self, faults: list[tuple[str, int]]) -> None:
        self.faults = faults  # (kind, step)

    def _at(self, step: int, *kinds: str) -> str | None:
        return next((k for k, s in self.faults if s == step and k in kinds), None)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        # step STEP is done (every callback's, the checkpoint callback's persist included): STEP + 1 starts
        step = trainer.global_step
        kind = self._at(step, "sigterm", "hang", "sigkill", "exception")
        if kind is None:
            return
        tiered = Suite.of(trainer).checkpoint
        assert tiered is not None and tiered.manager is not None
        if not tiered.manager.wait(timedelta(seconds=RUNAWAY_S)):  # let the persist in flight land first
            raise RuntimeError(f"the persist in flight at step {step} did not finish")
        print(f"DRILL: rank {trainer.global_rank} {kind} at step {step}", flush=True)
        if kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif kind == "hang":
            end = time.monotonic() + RUNAWAY_S
            while time.monotonic() < end:  # a rank stuck in a Python loop
                pass
        elif kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            raise RuntimeError(f"injected exception at step {step}")


class Report(Callback):
    def __init__(self, path: Path, report: dict[str, Any]) -> None:
        self.path, self.report = path, report

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, sort_keys=True, default=str))
        os.replace(tmp, self.path)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        tiered = Suite.of(trainer).checkpoint
        assert tiered is not None
        self.report.update(start_step=trainer.global_step, restored_step=tiered.stats.restored_step)
        self.write()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.report["final_step"] = trainer.global_step
        self.write()


def _fault(text: str) -> tuple[str, str, int, int]:
    attempt, kind, rank, step = text.split(":")
    if kind not in KINDS:
        raise argparse.ArgumentTypeError(f"fault kind must be one of {KINDS}, got {kind!r}")
    return attempt, kind, int(rank), int(step)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--fault", type=_fault, action="append", default=[])
    parser.add_argument("--step-time", type=float, default=0.0)
    args = parser.parse_args(argv)
    attempt = current_attempt()
    mine = [
        (kind, step)
        for a, kind, rank, step in args.fault
        if rank == attempt.rank and a in ("*", str(attempt.restart_count))
    ]
    report: dict[str, Any] = {"attempt": attempt.restart_count, "rank": attempt.rank, "launcher": attempt.launcher}
    reporter = Report(args.run_dir / "reports" / f"attempt{attempt.restart_count}_rank{attempt.rank}.json", report)
    ft = FaultTolerance(
        FaultToleranceConfig(
            run_dir=str(args.run_dir),  # the launcher's run directory: it reads the notes and dumps there
            initial_timeouts_s={"setup": 120.0, "step": 60.0, "out_of_section": 60.0, "checkpointing": 60.0},
            warmup_steps=3,
            safety_factor=5.0,
            min_timeout_s=4.0,
            max_timeout_s=60.0,
            ledger_interval_s=0.0,
            nvrx="off",
        )
    )
    tiers = [MemoryTier(every_n_steps=1, keep=2), LocalTier(args.run_dir / "ckpt", every_n_steps=PERSIST_EVERY, keep=2)]
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 16), torch.randn(512, 1))
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ResilientDDPStrategy(),
        max_steps=args.steps,
        callbacks=[ft, TieredCheckpoint(tiers), Faults(mine), reporter],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(MLP(args.step_time), DataLoader(data, batch_size=8, shuffle=True))
    except DecidedExit:  # the suite's code (a handled preemption): this attempt's report first, then the exit
        pass
    report.update(exit_code=ft.exit_code, preempted_at=ft.preempted_at)
    reporter.write()
    # torn down here: left to interpreter exit, gloo's threads can abort the process (SIGABRT)
    torch.distributed.destroy_process_group()
    return ft.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
