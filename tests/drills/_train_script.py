"""Fault-drill workload: the tiny GPT on 2 CPU ranks under ``torchrun``, with tiered checkpoints and one injected kill.

Run by ``tests/drills/test_torchrun_kill.py``, with ``PYTHONPATH`` set to the repository root, as::

    torchrun --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT \\
        tests/drills/_train_script.py --ckpt-dir CKPT --out OUT.pt --steps 20 [--kill-at-step K --kill-rank R]

On the first attempt only (``TORCHELASTIC_RESTART_COUNT == 0``) rank ``R`` SIGKILLs itself once step ``K`` is done:
no exception, no clean-up, no flush, as when a node disappears. torchrun then restarts every worker and the job must
resume on its own from the newest step that every rank committed.

Every attempt of every rank writes ``attempt<N>_rank<R>.json`` next to ``--out``: the checkpoint directory as this
process found it before the engine touched it, the step it restored, and (once training ends) the final step. Rank 0
of the attempt that finishes saves the final weights to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_resilience import LocalTier, ResilientDDPStrategy, TieredCheckpoint
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tier import Written
from lightning_resilience.checkpoint.tree import TensorSpec
from lightning_resilience.collective import Deadline
from tests.lightning._training import build, trainer, weights

PERSIST_EVERY = 5
STALL_LIMIT = timedelta(seconds=60)  # a stalled write outlives any drill: the process is killed long before
START_LIMIT = timedelta(seconds=20)  # a submitted persist reaches the disk within milliseconds


class _StallingSnapshot(StagedSnapshot):
    """A snapshot whose writer hangs after the data files are on disk and before the manifest is written.

    ``write_shard`` asks for the tensor specs only to build the manifest, so a hang here leaves exactly what a real
    disk stall leaves: a temporary shard directory with data files and no manifest, never renamed into place.
    """

    def __init__(self, snap: StagedSnapshot, stalled: threading.Event) -> None:
        super().__init__(snap.step, snap.skeleton, snap.tensors, dict(snap.meta))
        self._stalled = stalled

    def specs(self) -> dict[str, TensorSpec]:
        self._stalled.set()
        threading.Event().wait(STALL_LIMIT.total_seconds())
        return super().specs()


class StallingLocalTier(LocalTier):
    """A :class:`LocalTier` on a disk that stalls part way through writing one step (simulates a slow disk)."""

    def __init__(self, *args: Any, stall_step: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stall_step = stall_step
        self.stalled = threading.Event()

    def write(self, snap: StagedSnapshot, deadline: Deadline | None = None) -> Written:
        if snap.step == self.stall_step:
            snap = _StallingSnapshot(snap, self.stalled)
        return super().write(snap, deadline)


class KillAt(Callback):
    """SIGKILLs this process once global step ``step`` is done (as the next starts: the checkpoint callback, which
    runs last, has submitted the step's persist), optionally once that persist is in flight."""

    def __init__(self, step: int, in_flight: threading.Event | None = None) -> None:
        self.step = step
        self.in_flight = in_flight

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        # the persist runs on the engine's worker thread: wait until it is part way through writing the shard
        if self.in_flight is not None and not self.in_flight.wait(START_LIMIT.total_seconds()):
            raise RuntimeError(f"the persist of step {self.step} never started; the drill cannot kill during it")
        print(f"DRILL: rank {trainer.global_rank} SIGKILL at step {self.step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class SettlePersists(Callback):
    """Waits once global step ``step`` is done until this rank's in-flight persist has finished.

    On a loaded machine one persist can outlast the steps until the next is due; the engine then defers the next
    one on every rank, and a drill meant to kill during the persist of step K would wait for a write that starts
    only at K + 1. Settling every rank just before K makes the persist of K start on time, and guarantees that a
    kill soon after the first persist still finds it committed (the drill asserts the restart resumes, not restarts
    from scratch).
    """

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        tiered = next(c for c in trainer.callbacks if isinstance(c, TieredCheckpoint))
        assert tiered.manager is not None
        if not tiered.manager.wait(STALL_LIMIT):
            raise RuntimeError(f"the persist in flight at step {self.step} did not finish within {STALL_LIMIT}")


class AttemptReport(Callback):
    """Writes what this attempt found and restored, then what it finished with, as a small JSON file."""

    def __init__(self, path: Path, report: dict[str, Any]) -> None:
        self.path = path
        self.report = report

    def _write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.report, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        tiered = next(c for c in trainer.callbacks if isinstance(c, TieredCheckpoint))
        self.report.update(
            world_size=trainer.world_size,
            start_step=trainer.global_step,
            restored_step=tiered.stats.restored_step,
            restored_from=tiered.stats.restored_from,
        )
        self._write()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.report["final_step"] = trainer.global_step
        self._write()


def _listing(root: Path) -> dict[str, dict[str, list[str]]]:
    """Every step directory, every entry in it (committed shards and temporaries alike) and the files inside."""
    if not root.is_dir():
        return {}
    return {
        step.name: {e.name: sorted(f.name for f in e.iterdir()) if e.is_dir() else [] for e in sorted(step.iterdir())}
        for step in sorted(root.iterdir())
        if step.is_dir()
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", type=Path, required=True, help="LocalTier root")
    parser.add_argument("--out", type=Path, required=True, help="final weights (rank 0); reports go next to it")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-at-step", type=int, default=None, help="SIGKILL at the end of this step (attempt 0)")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument(
        "--kill-during-persist",
        action="store_true",
        help="stall the LocalTier write of --kill-at-step on --kill-rank and kill while it is in flight",
    )
    args = parser.parse_args(argv)
    if args.kill_during_persist and (args.kill_at_step is None or args.kill_at_step % PERSIST_EVERY):
        parser.error(f"--kill-during-persist needs --kill-at-step on a persist step (a multiple of {PERSIST_EVERY})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    # read before the engine binds its tiers, which removes this rank's stale temporaries
    report: dict[str, Any] = {"attempt": attempt, "rank": rank, "listing_before": _listing(args.ckpt_dir)}

    kill_here = args.kill_at_step is not None and attempt == 0 and rank == args.kill_rank
    stall = kill_here and args.kill_during_persist
    tier = StallingLocalTier(
        args.ckpt_dir, every_n_steps=PERSIST_EVERY, keep=2, stall_step=args.kill_at_step if stall else None
    )
    callbacks: list[Callback] = [
        TieredCheckpoint([tier]),
        AttemptReport(args.out.parent / f"attempt{attempt}_rank{rank}.json", report),
    ]
    if args.kill_at_step is not None and attempt == 0:  # every rank: the persists before the kill are on disk
        callbacks.append(SettlePersists(args.kill_at_step - 1))
    if kill_here:
        callbacks.append(KillAt(args.kill_at_step, tier.stalled if stall else None))

    model, data = build()
    fit = trainer(args.steps, callbacks, devices=2, strategy=ResilientDDPStrategy())
    fit.fit(model, datamodule=data)
    if fit.global_rank == 0:
        tmp = args.out.with_suffix(".tmp")
        torch.save(weights(model), tmp)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
    if torch.distributed.is_initialized():
        # an explicit teardown: left to interpreter exit, gloo's threads can abort the process (SIGABRT)
        torch.distributed.destroy_process_group()
