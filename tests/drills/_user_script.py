"""A plain Lightning user script, as a new user writes it, with the default resilience preset switched on.

What the user wrote (``main`` down to ``trainer.fit``): a map-style dataset whose items draw random augmentation,
``DataLoader(dataset, batch_size=8, shuffle=True, num_workers=W)``, a module with dropout and ``torch.randn`` noise
in ``training_step``, SGD with a ``StepLR`` scheduler, ``Trainer(strategy="ddp", devices=2)`` on CPU with gloo, and
the callbacks of ``resilience=default`` (tiered checkpoint to RAM and local disk, straggler detection, SDC guards,
watchdog and preemption handling). Lightning injects its ``DistributedSampler``; nothing in the script is ours but
the callbacks.

The drill harness (``tests/drills/_harness.py``) adds ``--fault KIND --fault-step K --fault-rank R --launch L``; the
fault fires in launch ``L`` (default 0) on its first torchrun attempt only:

* ``sigkill``: rank R SIGKILLs itself at the end of step K (no clean-up, no flush: a lost process);
* ``sigkill-persist``: rank R's local-disk write of step K stalls half-way, and rank R is SIGKILLed while it is in
  flight (K must be a persist step of the local tier);
* ``sigterm-rank``: rank R receives SIGTERM at the start of step K + 1 (a preemption notice on one rank);
* ``sigterm-launcher``: rank R sends SIGTERM to the torchrun launcher at the start of step K + 1 (the scheduler ends
  the job); the harness relaunches it.

Every attempt of every rank writes ``RUN/reports/launch<L>_attempt<N>_rank<R>.json`` (restored step, final step);
rank 0 of an attempt that reaches ``--steps`` writes the final weights to ``RUN/weights.pt``. The process exits with
the code the resilience callbacks asked for (a preemption: a restart is due).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_resilience import LocalTier, TieredCheckpoint
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.config.registry import register_configs
from recipes._resilience import exit_code, resilience_callbacks
from tests.drills._train_script import START_LIMIT, _StallingSnapshot

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ("none", "sigkill", "sigkill-persist", "sigterm-rank", "sigterm-launcher")


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


def default_preset_callbacks(run_dir: Path) -> list[Callback]:
    """The callbacks of ``resilience=default``, composed the way the recipes compose them."""
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("pretrain_gpt", overrides=[f"run_dir={run_dir}", "resilience=default"])
    return resilience_callbacks(cfg)


# ------------------------------------------------------------------------------------------------ drill plumbing
class Fault(Callback):
    """Injects one fault on one rank of one launch's first attempt (see the module docstring)."""

    def __init__(self, kind: str, step: int, rank: int) -> None:
        self.kind, self.step, self.rank = kind, step, rank
        self.in_flight = threading.Event()

    def arm_persist_stall(self, callbacks: list[Callback]) -> None:
        """Make the local tier's write of ``step`` stall after its data files, before its manifest."""
        tiered = next(c for c in callbacks if isinstance(c, TieredCheckpoint))
        local = next(t for t in tiered.tiers if isinstance(t, LocalTier))
        write, step, stalled = local.write, self.step, self.in_flight

        def stalling_write(snap: StagedSnapshot) -> None:
            write(_StallingSnapshot(snap, stalled) if snap.step == step else snap)

        local.write = stalling_write  # type: ignore[method-assign]

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if self.kind == "sigterm-rank":
            print(f"DRILL: rank {self.rank} SIGTERM at step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.kind == "sigterm-launcher":
            print(f"DRILL: rank {self.rank} SIGTERM to the launcher at step {self.step}", flush=True)
            os.kill(os.getppid(), signal.SIGTERM)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        # the persist of this step runs on the engine's thread: wait until it is half-way through the shard
        if self.kind == "sigkill-persist" and not self.in_flight.wait(START_LIMIT.total_seconds()):
            raise RuntimeError(f"the persist of step {self.step} never started; cannot kill during it")
        if self.kind in ("sigkill", "sigkill-persist"):
            print(f"DRILL: rank {self.rank} SIGKILL at step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class Report(Callback):
    """Writes what this attempt restored and where it ended, as a small JSON file."""

    def __init__(self, path: Path, report: dict[str, Any]) -> None:
        self.path, self.report = path, report

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, sort_keys=True))
        os.replace(tmp, self.path)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        tiered = next(c for c in trainer.callbacks if isinstance(c, TieredCheckpoint))  # type: ignore[attr-defined]
        self.report.update(restored_step=tiered.stats.restored_step, start_step=trainer.global_step)
        self._write()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.report["final_step"] = trainer.global_step
        self._write()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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


def main(argv: list[str]) -> int:
    args = _parse(argv)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))

    # ---- the user's script
    seed_everything(args.seed)
    loader = DataLoader(AugmentedPoints(), batch_size=8, shuffle=True, num_workers=args.workers)
    model = Regressor()
    callbacks = default_preset_callbacks(args.run_dir)
    # ---- the drill's additions
    tag = f"launch{args.launch}_attempt{attempt}_rank{rank}"
    extra: list[Callback] = [Report(args.run_dir / "reports" / f"{tag}.json", {"launch": args.launch})]
    if args.fault != "none" and attempt == 0 and args.launch == args.fault_launch:
        fault = Fault(args.fault, args.fault_step, args.fault_rank)
        if args.fault == "sigkill-persist" and rank == args.fault_rank:
            fault.arm_persist_stall(callbacks)
        extra.append(fault)
    # ---- the user's script
    trainer = Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp",
        callbacks=[*callbacks, *extra],  # a fault after the checkpoint callback: its step is snapshotted
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(args.run_dir),
    )
    trainer.fit(model, loader)
    if trainer.global_rank == 0 and trainer.global_step == args.steps:
        tmp = args.run_dir / "weights.tmp"
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, tmp)
        os.replace(tmp, args.run_dir / "weights.pt")
    return exit_code(callbacks)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if torch.distributed.is_initialized():
        # an explicit teardown: left to interpreter exit, gloo's threads can abort the process (SIGABRT)
        torch.distributed.destroy_process_group()
    sys.exit(code)
