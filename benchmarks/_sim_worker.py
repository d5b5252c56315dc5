"""One rank of one attempt of ``benchmarks.sim_validation``'s fault-injected run, started by torchrun: trains the tiny
GPT with a local tier and writes every event (steps, saves, restores, its end) to the run's event log, one line at a
time, synced (the next line may never come: the driver kills ranks). ``read_events`` reads such a log back.

Usage (by ``benchmarks.sim_validation``): ``torchrun ... _sim_worker.py --run-dir DIR --steps N --every K
--train-seed S``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["read_events", "worker"]


def _append(path: Path, record: dict[str, Any]) -> None:
    # one line per event, flushed and synced: the next line may never come (SIGKILL)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by the kill
            continue
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything

    from lightning_resilience import LocalTier, ResilientDDPStrategy, ResumableDataLoader, TieredCheckpoint
    from recipes._data import SyntheticTokenDataModule
    from recipes._gpt import TinyGPT

    torch.set_num_threads(1)
    run = Path(args.run_dir)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    events = run / f"events_rank{rank}.jsonl"
    kills = json.loads((run / "kills.json").read_text())["offsets_s"]
    t0_file = run / "t0.json"

    current_step: list[int | None] = [None]  # None until this attempt trains: a kill then hits the restart

    def killer() -> None:
        """Rank 1 dies at each scheduled time, whatever the job is doing then (starting, restoring, training)."""
        while not t0_file.exists():  # attempt 0: the schedule starts with the clock
            threading.Event().wait(0.05)
        t0 = float(json.loads(t0_file.read_text())["t0"])
        done = sum(1 for e in read_events(events) if e["event"] == "kill")
        if done >= len(kills):
            return
        threading.Event().wait(max(0.0, t0 + kills[done] - time.time()))
        step = current_step[0]
        if step is not None and step >= args.steps:
            return
        _append(events, {"event": "kill", "attempt": attempt, "t": time.time(), "step": step})
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == 1:
        threading.Thread(target=killer, name="sim-validation-killer", daemon=True).start()

    class Timeline(Callback):
        def __init__(self) -> None:
            self.first = True

        def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *a: Any) -> None:
            if not self.first:
                return
            self.first = False
            now = time.time()
            tiered = next(c for c in trainer.callbacks if isinstance(c, TieredCheckpoint))
            s = tiered.stats
            _append(
                events,
                {
                    "event": "first_batch",
                    "attempt": attempt,
                    "t": now,
                    "step": trainer.global_step,
                    "restored_step": s.restored_step,
                    "restore_s": s.restore_seconds,
                },
            )

        def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *a: Any) -> None:
            now = time.time()
            step = trainer.global_step
            current_step[0] = step
            if rank == 0:
                _append(events, {"event": "step", "attempt": attempt, "t": now, "step": step})
                if attempt == 0 and step == args.every:  # the clock starts once start-up and warm-up are over
                    tmp = t0_file.with_suffix(".tmp")
                    tmp.write_text(json.dumps({"t0": now}))
                    os.replace(tmp, t0_file)

        def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            if rank != 0:
                return
            tiered = next(c for c in trainer.callbacks if isinstance(c, TieredCheckpoint))
            s = tiered.stats
            _append(
                events,
                {
                    "event": "end",
                    "attempt": attempt,
                    "t": time.time(),
                    "step": trainer.global_step,
                    "tiers": {n: vars(t) for n, t in s.tiers.items()},
                    "captures": s.captures,
                    "capture_seconds_mean": s.capture_seconds_mean,
                },
            )

    seed_everything(args.train_seed, workers=True)
    model = TinyGPT(
        vocab_size=256, seq_len=64, d_model=128, n_layer=2, n_head=4, dropout=0.0, warmup_steps=5, max_steps=10_000
    )
    data = SyntheticTokenDataModule(
        batch_size=16, num_samples=16384, seq_len=64, vocab_size=256, seed=3, loader_cls=ResumableDataLoader
    )
    tier = LocalTier(run / "ckpt", every_n_steps=args.every, keep=2)
    trainer = Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),  # one node: torchrun's ranks
        strategy=ResilientDDPStrategy(),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[TieredCheckpoint([tier]), Timeline()],
    )
    trainer.fit(model, datamodule=data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, required=True)
    p.add_argument("--train-seed", type=int, required=True)
    worker(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
