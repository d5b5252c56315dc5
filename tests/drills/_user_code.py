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
  relaunches it;
* ``sigkill-midstep``: rank R SIGKILLs itself inside step K + 1, after its backward (gradients all-reduced) and
  before its optimizer step;
* ``sigkill-restore``: ``sigkill``, then on the restarted attempt rank R is SIGKILLed while it reads its shard of
  the restored step (armed by the script that owns the tier);
* ``hang-collective``: rank R blocks inside the step agreement of step K + 1 (armed through the side
  groups' fault hook by the script); the other rank's deadline or the watchdog ends the attempt;
* ``corrupt-shard`` / ``truncate-shard``: rank R flips bytes in (or cuts in half) the largest file of its newest
  committed shard on disk, then SIGKILLs itself; the restart must not load that step;
* ``enospc``: rank R's local-disk write of the persist step before K fails with ENOSPC half-way (a full disk, armed by
  the script), training goes on, then rank R SIGKILLs itself at K; the restart must not load the failed step;
* ``disk-full``: the node's checkpoint directory is a small tmpfs (mounted by the campaign); the step before the
  persist step P before K, rank R fills it, so every rank's local-disk write of P fails with ENOSPC from the
  filesystem itself; training goes on, then rank R SIGKILLs itself at K. The disk stays full: the restart must
  restore the newest step committed before P, and train on while every later persist fails;
* ``node-loss``: rank R's node is lost with its RAM and disk: its shards and its snapshots in shared memory are
  deleted and it SIGKILLs itself;
* ``ram-loss``: rank R's node loses its RAM but keeps its disk (a reboot): its snapshots in shared memory are deleted
  and it SIGKILLs itself; the restart goes back to the disk tier;
* ``sigkill-both``: every rank SIGKILLs itself as step K + 1 starts (after a barrier: all of them have done step K);
* ``sigkill-snapshot``: rank R is SIGKILLed while the snapshot copy of step K is half-way (armed by the script: the
  background copy stalls after half of its tensors); the restart must restore the step before K;
* ``sigkill-peer-send``: with ``--checkpoint tiered`` (a peer tier), rank R is SIGKILLed as it starts sending its
  shard of peer step K to its peer, which is waiting to receive it (armed by the script that owns the tier);
* ``s3-outage``: with ``--checkpoint s3`` (a remote tier on a local S3 server), the server is killed as rank R
  starts uploading the persist step before K and comes back seconds later (armed by the script); at K, once its
  persists settled, rank R loses its node's disk and is SIGKILLed: the restart must restore the newest step every
  rank has somewhere, rank R's from the store (its shared memory is lost with the node).

Every fault writes ``RUN/faults.jsonl`` (one line per fault: kind, rank, step, wall time, the step it damaged and
the copy of it, ``tier``: the disk's for a shard, the RAM tier's for a half-made snapshot) before it fires; every
attempt's report gives what the checkpoint directory and the node's shared memory held before the engine touched them
(``committed``: step -> ranks; ``elsewhere``: the same without the checkpoint directory), the restored step and tier
and the wall time of its first step.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import Dataset

FAULTS = (
    "none",
    "sigkill",
    "sigkill-persist",
    "sigterm-rank",
    "sigterm-launcher",
    "sigkill-midstep",
    "sigkill-restore",
    "hang-collective",
    "corrupt-shard",
    "truncate-shard",
    "enospc",
    "node-loss",
    "sigkill-peer-send",
    "s3-outage",
    "disk-full",
    "ram-loss",
    "sigkill-both",
    "sigkill-snapshot",
)
CHECKPOINTS = ("local", "tiered", "s3")
"""``--checkpoint``: the checkpoint preset of ``resilience=default`` (``local``) or ``resilience/checkpoint=tiered``
(RAM, a peer tier every 5 steps with each of the 2 ranks its own node, local disk every 20 steps) or
``resilience/checkpoint=tiered_s3`` (RAM, local disk and an S3 store, both every 10 steps)."""
OVERRIDES_ENV = "DRILL_OVERRIDES"
"""More Hydra overrides of the default preset for every launch of a drill (whitespace-separated): a campaign's
variant, e.g. the RAM tier held in the process (``resilience.checkpoint.tiers.0.shared_memory=false``)."""
PERSIST_EVERY = 10  # the local tier's cadence in the default preset (configs/resilience/checkpoint/local.yaml)
START_LIMIT_S = 20.0  # a submitted persist reaches the disk within milliseconds
Restored = Callable[[Trainer], "int | tuple[int | None, str | None] | None"]
"""The step an attempt restored (None: started fresh), or that step and the tier it came from."""


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
_SHARD = re.compile(r"^rank_(\d+)$")
_STEP = re.compile(r"^step_(\d+)$")


def committed(run_dir: Path) -> dict[int, list[int]]:
    """Step -> ranks whose shard of it is committed in some tier on disk: the local tier's directory and the peer
    tier's node directories (a rank's own shards and the copies it holds for its peer)."""
    out: dict[int, set[int]] = {}
    for directory in [run_dir / "ckpt", *sorted((run_dir / "peer").glob("node*"))]:
        for step, ranks in committed_in(directory).items():
            out.setdefault(step, set()).update(ranks)
    return {step: sorted(ranks) for step, ranks in out.items()}


def committed_in(ckpt_dir: Path) -> dict[int, list[int]]:
    """Step -> ranks whose shard of it is committed (renamed into place) in one tier's directory."""
    out: dict[int, list[int]] = {}
    if ckpt_dir.is_dir():
        for step_dir in ckpt_dir.iterdir():
            step = _STEP.match(step_dir.name)
            if step is None or not step_dir.is_dir():
                continue
            ranks = sorted(int(m.group(1)) for e in step_dir.iterdir() if (m := _SHARD.match(e.name)) and e.is_dir())
            if ranks:
                out[int(step.group(1))] = ranks
    return out


def fill(directory: Path) -> int:
    """Fill the filesystem of ``directory`` (a drill's tmpfs) until it reports ENOSPC; returns the bytes written."""
    written, block = 0, b"\0" * 2**16
    print(f"DRILL: filling the disk of {directory}", flush=True)
    with open(directory / "filler", "wb") as f:
        try:
            while True:
                written += f.write(block)
                f.flush()
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
    return written


DISK, MEMORY = "local", "memory"
"""The copy a fault damaged (a fault record's ``tier``: the name a restore reports for its tier). The other tiers'
copies of that step are intact: a restore of the step from one of them is right."""


def record_fault(run_dir: Path, **fields: Any) -> None:
    """Append one fault to ``RUN/faults.jsonl`` (synced: the process may die right after)."""
    with open(run_dir / "faults.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), **fields}, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _damage(shard: Path, how: str) -> None:
    """Flip bytes in the middle of (or cut in half) the largest file of a committed shard, as bit rot or a torn write
    leaves it; the manifest stays as it was."""
    files = [f for f in shard.iterdir() if f.is_file() and f.name != "manifest.json"]
    victim = max(files, key=lambda f: f.stat().st_size)
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        if how == "truncate-shard":
            f.truncate(size // 2)
        else:
            f.seek(size // 2)
            data = f.read(16)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in data))
        f.flush()
        os.fsync(f.fileno())


class Fault(Callback):
    """Injects one fault on one rank (see the module docstring)."""

    def __init__(self, kind: str, step: int, rank: int, run_dir: Path) -> None:
        self.kind, self.step, self.rank, self.run_dir = kind, step, rank, run_dir
        self.in_flight = threading.Event()
        """Set by an armed persist stall once the write of ``step`` is half-way through (``sigkill-persist``), or
        once the failing write has failed (``enospc``)."""
        self.settle: Callable[[], object] = lambda: None
        """Waits for this rank's persists in flight (set by the script that owns the checkpoint engine): a fault that
        needs a committed step (to damage, to delete, to be killed restoring) settles first, so a slow disk on a
        loaded machine cannot leave it nothing to hit."""
        self.lose_ram: Callable[[], object] = lambda: None
        """Deletes this rank's snapshots in the node's shared memory (set by the script that knows where they are)."""

    @property
    def _persist_step(self) -> int:
        """The persist step a ``sigkill-persist``, ``enospc``, ``disk-full`` or ``s3-outage`` fault hits."""
        return self.step if self.kind == "sigkill-persist" else self.step // PERSIST_EVERY * PERSIST_EVERY

    def _record(self, **fields: Any) -> None:
        record_fault(self.run_dir, kind=self.kind, rank=self.rank, step=self.step, **fields)

    def _kill(self) -> None:
        print(f"DRILL: rank {self.rank} {self.kind} after step {self.step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def on_before_optimizer_step(self, trainer: Trainer, *args: Any) -> None:
        if self.kind == "sigkill-midstep" and trainer.global_rank == self.rank and trainer.global_step == self.step:
            self._record()
            self._kill()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self.kind == "sigkill-both" and trainer.global_step == self.step:
            trainer.strategy.barrier("sigkill-both")  # every rank has finished step K: none dies inside it
            self._record()
            print(f"DRILL: rank {trainer.global_rank} sigkill-both after step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        hits_persist = self.kind in ("sigkill-persist", "enospc", "s3-outage", "disk-full")
        if hits_persist and trainer.global_step == self._persist_step - 1:
            # every rank, the step before the persist the fault hits: a persist that finds the previous one still
            # being written (a loaded machine) is deferred to a later step, and the fault would wait for nothing
            self.settle()
            if self.kind == "disk-full" and trainer.global_rank == self.rank:
                fill(self.run_dir / "ckpt")
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if self.kind == "sigterm-rank":
            self._record()
            print(f"DRILL: rank {self.rank} SIGTERM after step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.kind == "sigterm-launcher":
            self._record()
            print(f"DRILL: rank {self.rank} SIGTERM to the launcher after step {self.step}", flush=True)
            os.kill(os.getppid(), signal.SIGTERM)
        if self.kind in ("sigkill-restore", "corrupt-shard", "truncate-shard", "node-loss", "s3-outage", "disk-full"):
            self.settle()  # disk-full: the failing persist of P has failed on this rank
        if self.kind == "disk-full":
            self._record(damaged=self._persist_step, tier=DISK)
            self._kill()
        if self.kind in ("sigkill", "sigkill-restore", "sigkill-persist", "enospc", "sigkill-snapshot"):
            # the persist (the snapshot copy) runs on the engine's thread: wait until it is half-way through the
            # shard (or has failed)
            if self.kind in ("sigkill-persist", "enospc") and not self.in_flight.wait(START_LIMIT_S):
                raise RuntimeError(f"the persist before step {self.step} never started; cannot fault during it")
            if self.kind == "sigkill-snapshot" and not self.in_flight.wait(START_LIMIT_S):
                raise RuntimeError(f"the snapshot copy of step {self.step} never started; cannot fault during it")
            hit = self.kind in ("sigkill-persist", "enospc")
            damaged = self._persist_step if hit else self.step if self.kind == "sigkill-snapshot" else None
            copy = {} if damaged is None else {"tier": MEMORY if self.kind == "sigkill-snapshot" else DISK}
            self._record(damaged=damaged, **copy)
            self._kill()
        elif self.kind == "ram-loss":
            self._record(damaged=None)
            self.lose_ram()
            self._kill()
        elif self.kind in ("corrupt-shard", "truncate-shard", "node-loss", "s3-outage"):
            mine = sorted(s for s, ranks in committed_in(self.run_dir / "ckpt").items() if self.rank in ranks)
            shards = [self.run_dir / "ckpt" / f"step_{s:012d}" / f"rank_{self.rank:05d}" for s in mine]
            if self.kind == "s3-outage":  # the node is lost: its shards are no longer anywhere but the store
                self._record(damaged=None, phase="node-loss")
                for shard in shards:
                    shutil.rmtree(shard)
                self.lose_ram()
            elif self.kind == "node-loss":
                self._record(damaged=mine, tier=DISK)  # its shared memory goes too: no whole snapshot is left there
                for shard in shards:  # the node's disk and RAM are gone with it
                    shutil.rmtree(shard)
                self.lose_ram()
            elif shards:
                self._record(damaged=mine[-1], tier=DISK)
                _damage(shards[-1], self.kind)
            else:
                self._record(damaged=None)
            self._kill()


class Report(Callback):
    """Writes what this attempt restored and where it ended, as a small JSON file.

    ``restored`` gives the restored step (None: started fresh), or the step and the tier it came from; by default a
    run that starts past step 0 restored it.
    """

    def __init__(self, path: Path, report: dict[str, Any], restored: Restored | None = None):
        self.path, self.report = path, report
        self.restored = restored or (lambda trainer: trainer.global_step or None)

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, sort_keys=True))
        os.replace(tmp, self.path)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        restored = self.restored(trainer)
        step, source = restored if isinstance(restored, tuple) else (restored, None)
        self.report.update(restored_step=step, restored_from=source, start_step=trainer.global_step)
        self._write()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if "first_step_time" not in self.report:  # the first step after the restore: the job is training again
            self.report["first_step_time"] = time.time()
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
    parser.add_argument("--checkpoint", choices=CHECKPOINTS, default="local", help="the checkpoint preset")
    return parser.parse_args(argv)


def drill_callbacks(
    args: argparse.Namespace,
    restored: Restored | None = None,
    *elsewhere: Callable[[], dict[int, list[int]]],
) -> list[Any]:
    """This attempt's report, and the fault when this launch's first attempt is the one to hit. ``elsewhere`` list
    what other tiers hold (step -> ranks: a remote store, the node's shared memory), for the report's
    ``committed`` (with the checkpoint directory's) and ``elsewhere`` (theirs alone: copies a damaged disk shard
    leaves intact)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    tag = f"launch{args.launch}_attempt{attempt}_rank{int(os.environ.get('RANK', '0'))}"
    # what the checkpoint directory held before the engine touched it (the restart's own view of what is committed)
    held, away = committed(args.run_dir), {}
    for listing in elsewhere:
        for step, ranks in listing().items():
            held[step] = sorted(set(held.get(step, [])) | set(ranks))
            away[step] = sorted(set(away.get(step, [])) | set(ranks))
    before = {"launch": args.launch, "committed": held, "elsewhere": away, "start_time": time.time()}
    out: list[Any] = [Report(args.run_dir / "reports" / f"{tag}.json", before, restored)]
    in_plumbing = ("none", "hang-collective", "sigkill-peer-send")  # armed by the script inside our tiers and groups
    if args.fault not in in_plumbing and attempt == 0 and args.launch == args.fault_launch:
        out.append(Fault(args.fault, args.fault_step, args.fault_rank, args.run_dir))
    return out


def save_weights(trainer: Trainer, model: torch.nn.Module, args: argparse.Namespace) -> None:
    """Rank 0 of the attempt that reached ``--steps`` writes the final weights."""
    if trainer.global_rank == 0 and trainer.global_step == args.steps:
        tmp = args.run_dir / "weights.tmp"
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, tmp)
        os.replace(tmp, args.run_dir / "weights.pt")
