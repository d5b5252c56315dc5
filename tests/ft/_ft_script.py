"""Fault-tolerance drill workload: the tiny GPT on 2 CPU ranks under ``torchrun`` with one injected fault.

Run by ``tests/ft/test_ft_drills.py`` (and ``benchmarks/ft_recovery.py``) with ``PYTHONPATH`` at the repository root::

    torchrun --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT \\
        tests/ft/_ft_script.py --run-dir RUN --steps 20 [--fault KIND --fault-step K --fault-rank R]

On the first attempt only (``TORCHELASTIC_RESTART_COUNT == 0``) rank ``R`` injects ``KIND`` around step ``K``:

* ``exception``: raises at the end of step K;
* ``sigkill``: SIGKILLs itself at the end of step K;
* ``hang-loop``: spins in a Python loop at the start of step K + 1;
* ``hang-collective``: enters an all-reduce its peers never join, at the start of step K + 1;
* ``sigterm``: sends itself SIGTERM (a preemption notice) at the start of step K + 1.

Each attempt of each rank writes ``RUN/reports/attempt<N>_rank<R>.json``; rank 0 of an attempt that finishes all
steps writes the final weights to ``RUN/weights.pt``. The process exits with ``FaultTolerance.exit_code``.
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
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_resilience import LocalTier, MemoryTier, ResilientDDPStrategy, TieredCheckpoint
from lightning_resilience.exit_codes import DecidedExit
from lightning_resilience.ft.config import FaultToleranceConfig
from lightning_resilience.lightning.callbacks.fault_tolerance import FaultTolerance
from tests.lightning._training import build, trainer, weights

PERSIST_EVERY = 5
RUNAWAY_S = 120.0  # an injected hang ends by itself after this long, should the watchdog fail to end it
FAULTS = ("none", "exception", "sigkill", "hang-loop", "hang-collective", "sigterm")


def _spin_forever(deadline_s: float) -> None:
    """A rank stuck in a Python loop (holding the GIL between switches, as a livelocked data loader would)."""
    end = time.monotonic() + deadline_s
    x = 0
    while time.monotonic() < end:
        x += 1


def _stuck_in_collective(group: Any) -> None:
    """A rank stuck in a collective its peers never join."""
    dist.all_reduce(torch.ones(1), group=group)


class InjectFault(Callback):
    """Injects one fault on this rank (see the module docstring)."""

    def __init__(self, kind: str, step: int) -> None:
        self.kind = kind
        self.step = step
        self.group: Any = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # every rank creates it (new_group is collective); only the faulty rank ever uses it
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=RUNAWAY_S))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step != self.step or self.kind not in ("hang-loop", "hang-collective", "sigterm"):
            return
        print(f"DRILL: rank {trainer.global_rank} {self.kind} at step {self.step}", flush=True)
        if self.kind == "hang-loop":
            _spin_forever(RUNAWAY_S)
        elif self.kind == "hang-collective":
            _stuck_in_collective(self.group)
        elif self.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step - 1:
            # every rank, one step before the fault: let the persist in flight land, so that the drill tests the
            # resume from it rather than how far a loaded machine got with its background writes
            tiered = next(c for c in trainer.callbacks if isinstance(c, TieredCheckpoint))
            assert tiered.manager is not None
            if not tiered.manager.wait(timedelta(seconds=RUNAWAY_S)):
                raise RuntimeError(f"the persist in flight at step {trainer.global_step} did not finish")
        if trainer.global_step != self.step:
            return
        if self.kind == "exception":
            print(f"DRILL: rank {trainer.global_rank} exception at step {self.step}", flush=True)
            raise RuntimeError(f"injected exception at step {self.step}")
        if self.kind == "sigkill":
            print(f"DRILL: rank {trainer.global_rank} sigkill at step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class AttemptReport(Callback):
    """What this attempt restored, where it stopped, and the fault-tolerance figures, as a small JSON file."""

    def __init__(self, path: Path, report: dict[str, Any]) -> None:
        self.path = path
        self.report = report

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.report, indent=1, sort_keys=True, default=str))
        os.replace(tmp, self.path)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        tiered = next(c for c in trainer.callbacks if isinstance(c, TieredCheckpoint))
        ft = next(c for c in trainer.callbacks if isinstance(c, FaultTolerance))
        self.report.update(
            world_size=trainer.world_size,
            start_step=trainer.global_step,
            restored_step=tiered.stats.restored_step,
            timeouts_at_start=ft.calibrator.timeouts(),
            calibrated_at_start=ft.calibrator.calibrated("step"),
        )
        self.write()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.report["final_step"] = trainer.global_step
        self.write()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-step", type=int, default=10)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--min-timeout", type=float, default=4.0, help="lower bound of calibrated timeouts (s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    report: dict[str, Any] = {"attempt": attempt, "rank": rank, "pid": os.getpid()}
    reporter = AttemptReport(args.run_dir / "reports" / f"attempt{attempt}_rank{rank}.json", report)
    ft = FaultTolerance(
        FaultToleranceConfig(
            run_dir=str(args.run_dir / "ft"),
            initial_timeouts_s={"setup": 120.0, "step": 60.0, "out_of_section": 60.0, "checkpointing": 60.0},
            warmup_steps=3,
            safety_factor=5.0,
            min_timeout_s=args.min_timeout,
            max_timeout_s=60.0,
            ledger_interval_s=0.0,
            nvrx="auto",
        )
    )
    tiers = [MemoryTier(every_n_steps=1, keep=2), LocalTier(args.run_dir / "ckpt", every_n_steps=PERSIST_EVERY, keep=2)]
    callbacks: list[Callback] = [ft, TieredCheckpoint(tiers), reporter]
    # on every rank and attempt: its side group is created collectively; only the faulty rank injects
    inject = attempt == 0 and rank == args.fault_rank
    callbacks.append(InjectFault(args.fault if inject else "none", args.fault_step))

    model, data = build()
    fit = trainer(args.steps, callbacks, devices=2, strategy=ResilientDDPStrategy())
    try:
        fit.fit(model, datamodule=data)
    except DecidedExit:  # the suite's code (a handled preemption): this attempt's report first, then the exit
        pass
    report.update(exit_code=ft.exit_code, preempted_at=ft.preempted_at, emergency_saved=ft.emergency_saved)
    report["ft"] = ft.report()
    report["summary"] = ft.summary()
    reporter.write()
    if fit.global_rank == 0 and ft.exit_code == 0 and fit.global_step == args.steps:
        tmp = args.run_dir / "weights.pt.tmp"
        torch.save(weights(model), tmp)
        os.replace(tmp, args.run_dir / "weights.pt")
    return ft.exit_code


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if torch.distributed.is_initialized():
        # an explicit teardown: left to interpreter exit, gloo's threads can abort the process (SIGABRT)
        torch.distributed.destroy_process_group()
    sys.exit(code)
