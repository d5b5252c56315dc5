"""The checkpoint benchmark's scenarios: the interleaved step-time rotation, the Lightning runs, and restore.

Every figure is a ratio against a baseline measured in the same run: contenders take turns on one model, and the
Lightning passes alternate their order, so all see the same (shared, drifting) machine.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._checkpoint.contenders import DISK_EVERY, Contender, DcpBest, Ours
from benchmarks._common import evict_page_cache, print_flush, summarize, tail_key
from benchmarks._workload import GPTWorkload, StepClock

__all__ = ["LIGHTNING_KINDS", "run_lightning", "run_restore", "run_rotation", "slowdown"]

pc = time.perf_counter


def run_rotation(
    wl: GPTWorkload, contenders: list[Contender], *, warmup: int, turn: int, rounds: int, device: str = "cpu"
) -> dict[str, dict[str, list[float]]]:
    """Each contender trains ``turn`` consecutive steps in turn, ``rounds`` times (order reversed every other round),
    after an untimed warm-up turn of ``warmup`` steps each.

    A turn's step numbers start at a multiple of :data:`DISK_EVERY`, so its disk save comes on the turn's first step.
    A step's time runs from its start to the next step's start (a wait inside the next step lands on the step of the
    contender that caused it). When background work (a disk write) is still running after the turn's last step, the
    contender trains on, recorded, without a new disk save (as a training loop would while the write finishes), for
    at most another ``turn`` steps; what is still left then is drained, timed apart (``drain_s``) and never folded
    into a step.
    """
    clock = StepClock(device)
    keys = ("step_s", "blocking_s", "snapshot", "turn_s", "drain_s", "tail_steps")
    rec: dict[str, dict[str, list[float]]] = {c.name: {k: [] for k in keys} for c in contenders}
    steps = dict.fromkeys(rec, DISK_EVERY * 1000)

    def one_turn(c: Contender, n: int, record: bool) -> None:
        steps[c.name] = -(-steps[c.name] // DISK_EVERY) * DISK_EVERY  # the disk save on the turn's first step
        c.begin()
        c.take_blocking()
        blocked: list[float] = []
        took: list[float] = []  # 1.0 where the step took a snapshot
        clock.mark()
        start = pc()

        def step(disk: bool) -> None:
            wl.step()
            if not disk and steps[c.name] % DISK_EVERY == 0:
                steps[c.name] += 1
            c.after_step(steps[c.name], disk)
            steps[c.name] += 1
            blocked.append(c.take_blocking())
            took.append(float(c.take_snapshot()))
            clock.mark()

        for _ in range(n):
            step(True)
        tail = 0
        while tail < n and c.busy():
            step(False)
            tail += 1
        times = clock.intervals()
        trained = pc() - start
        t0 = pc()
        c.end_turn()
        drain = pc() - t0
        blocked[-1] += c.take_blocking()
        print_flush(
            f"[rotation] {c.name}: {len(times)} steps, mean {sum(times) / max(len(times), 1) * 1e3:.1f} ms, "
            f"drain {drain * 1e3:.0f} ms{'' if record else ' (warm-up)'}"
        )  # a run stopped at its limit still shows the turns it finished
        if record:
            r = rec[c.name]
            r["step_s"] += times
            r["blocking_s"] += blocked
            r["snapshot"] += took
            r["turn_s"].append(trained)
            r["drain_s"].append(drain)
            r["tail_steps"].append(tail)
        gc.collect()

    for c in contenders:
        one_turn(c, warmup, record=False)
    for i in range(rounds):
        for c in contenders if i % 2 == 0 else contenders[::-1]:
            one_turn(c, turn, record=True)
    return rec


def slowdown(rec: dict[str, dict[str, list[float]]], name: str, base: str = "none") -> dict[str, Any]:
    """Step-time slowdown of ``name`` against ``base``: of the means, medians and tails (p99 from 100 samples up,
    else the maximum), the mean with the drains counted, and per round (the spread the machine's drift leaves)."""
    mine, ref = summarize(rec[name]["step_s"]), summarize(rec[base]["step_s"])
    turns = [
        (a / x) / (b / y) - 1.0
        for a, x, b, y in zip(rec[name]["turn_s"], _steps_per_turn(rec, name), rec[base]["turn_s"],
                              _steps_per_turn(rec, base))
    ]  # fmt: skip

    def rel(key: str) -> float | None:
        return mine[key] / ref[key] - 1.0 if mine[key] and ref[key] else None

    drained = (sum(rec[name]["step_s"]) + sum(rec[name]["drain_s"])) / max(len(rec[name]["step_s"]), 1)
    return {
        "mean": rel("mean_s"),
        "median": rel("median_s"),
        "p99": rel(tail_key(mine)),
        "tail": tail_key(mine).removesuffix("_s"),
        "mean_with_drain": drained / ref["mean_s"] - 1.0 if ref["mean_s"] else None,
        "per_turn": turns,
    }


def within_turns(rec: dict[str, dict[str, list[float]]], name: str) -> dict[str, Any] | None:
    """What checkpointing costs ``name``'s steps, measured inside its own turns: each turn's mean step over the mean
    of its steps that neither a snapshot nor the background copy of the one before touched (no snapshot at the step
    nor at the one before it), less one; then over the turns. A contender's drift between its turns and the
    baseline's cancels out, so this resolves far finer than :func:`slowdown`; it misses what a contender's threads
    take from every step alike (a persist writing for seconds), which :func:`slowdown` holds. None when no turn has
    enough untouched steps (a snapshot at every step), or when the contender never said it took one (only
    :class:`~benchmarks._checkpoint.contenders.Ours` does: every step would count as untouched)."""
    if not any(rec[name]["snapshot"]):
        return None
    turns: list[float] = []
    at = 0
    for n in _steps_per_turn(rec, name):
        steps, snapshot = rec[name]["step_s"][at : at + n], rec[name]["snapshot"][at : at + n]
        at += n
        clean = [s for i, s in enumerate(steps) if i > 0 and not snapshot[i] and not snapshot[i - 1]]
        if len(clean) >= 4:
            turns.append(sum(steps) / len(steps) / (sum(clean) / len(clean)) - 1.0)
    if not turns:
        return None
    return {"mean": sum(turns) / len(turns), "per_turn": turns}


def _steps_per_turn(rec: dict[str, dict[str, list[float]]], name: str) -> list[int]:
    turns = len(rec[name]["turn_s"])
    per = int(len(rec[name]["step_s"]) - sum(rec[name]["tail_steps"])) // turns if turns else 0
    return [per + int(t) for t in rec[name]["tail_steps"]]


# --------------------------------------------------------------------------------------------- Lightning runs
_STEP_RE = re.compile(r"step=(\d+)")


LIGHTNING_KINDS = {
    "none": "no checkpointing",
    "tiered": "TieredCheckpoint, the default preset: RAM every step + local disk every 10",
    "tiered_budget": "TieredCheckpoint, the budget preset: both cadences chosen by the 2% overhead budget",
    "modelcheckpoint_same": "ModelCheckpoint every step to tmpfs (RAM, the newest kept) + ModelCheckpoint every 10 to "
    "the local disk, AsyncCheckpointIO: our cadence",
    "modelcheckpoint_best": "ModelCheckpoint every 10 steps to the local disk, AsyncCheckpointIO: its own best cadence",
}
"""The Trainer runs the benchmark compares, and what each checkpoints."""


def run_lightning(
    kind: str,
    model_kwargs: dict[str, Any],
    batch_size: int,
    root: Path,
    steps: int,
    warmup: int,
    threads: int,
    ram_root: Path | None = None,
) -> dict[str, Any]:
    """One Trainer run of ``kind`` (:data:`LIGHTNING_KINDS`). The mean step time runs from the first measured step
    to the end of ``fit`` (the drain of background saves after the last step included); per-step intervals (batch
    start to batch start) give the median and the tail. ``ram_root``: a tmpfs directory for the per-step saves."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_resilience.checkpoint import LocalTier, MemoryTier
    from lightning_resilience.checkpoint.tier import BUDGET
    from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint
    from recipes._data import SyntheticTokenDataModule
    from recipes._gpt import TinyGPT

    ckpt_dir = root / "ckpt"
    ram_dir = (ram_root or root) / "ram"
    callbacks: list[Any] = []
    plugins: list[Any] = []
    if kind in ("tiered", "tiered_budget"):
        every = (1, DISK_EVERY) if kind == "tiered" else (BUDGET, BUDGET)
        tiers = [MemoryTier(every_n_steps=every[0], keep=2), LocalTier(ckpt_dir, every_n_steps=every[1], keep=3)]
        callbacks.append(TieredCheckpoint(tiers=tiers, resume="never"))
    elif kind in ("modelcheckpoint_same", "modelcheckpoint_best"):
        if kind == "modelcheckpoint_same":
            # the newest only, as ``last.ckpt`` replaced each step: every step kept would fill the machine's RAM
            # (tmpfs), and ``save_top_k=1`` removes the previous file while AsyncCheckpointIO may still be moving it
            # into place (FileNotFoundError)
            callbacks.append(ModelCheckpoint(dirpath=ram_dir, every_n_train_steps=1, save_top_k=0, save_last=True))
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=DISK_EVERY, save_top_k=-1))
        plugins.append(AsyncCheckpointIO())
    elif kind != "none":
        raise ValueError(kind)

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.cleanup: list[float] = []

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            torch.set_num_threads(threads)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            t0 = pc()
            # keep the directories bounded (save_top_k=-1 keeps all): drop all but the two newest files, untimed
            for where in (ckpt_dir, ram_dir) if kind.startswith("modelcheckpoint") else ():
                files = sorted(where.glob("*.ckpt"), key=lambda p: int(m[1]) if (m := _STEP_RE.search(p.name)) else -1)
                for old in files[:-2]:
                    with contextlib.suppress(FileNotFoundError):
                        old.unlink()
            now = pc()
            self.cleanup.append(now - t0)
            self.starts.append(now)

    timer = StepTimer()
    torch.manual_seed(0)
    model = TinyGPT(**model_kwargs)
    total = warmup + steps
    data = SyntheticTokenDataModule(
        batch_size=batch_size,
        num_samples=batch_size * (total + 2),
        seq_len=model_kwargs["seq_len"],
        vocab_size=model_kwargs["vocab_size"],
        seed=1,
    )
    trainer = Trainer(
        max_steps=total,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=kind != "none",  # TieredCheckpoint is a Lightning Checkpoint too
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=root,
        callbacks=[timer, *callbacks],
        plugins=plugins or None,
    )
    trainer.fit(model, datamodule=data)  # returns after AsyncCheckpointIO's teardown drained its queue
    end = pc()
    starts = timer.starts[warmup:]
    intervals = [b - a - c for a, b, c in zip(starts, starts[1:], timer.cleanup[warmup + 1 :])]
    mean_with_drain = (end - starts[0] - sum(timer.cleanup[warmup + 1 :])) / len(starts)
    return {
        "kind": kind,
        "step_interval": summarize(intervals),
        "mean_step_with_drain_s": mean_with_drain,
        "after_last_step_s": end - starts[-1],
    }


# --------------------------------------------------------------------------------------------------- restore
def run_restore(wl: GPTWorkload, ours: Ours, root: Path, dcp: DcpBest | None, reps: int) -> dict[str, Any]:
    """Restore the state and apply it to the live model and optimizer (``load_state_dict``): the time a user waits.

    * ours, RAM tier: ``CheckpointManager.restore`` hands the snapshot buffers over (a fresh untimed snapshot is
      taken before each repetition);
    * ours, local disk tier: a fresh manager with only that tier, page cache warm and evicted;
    * DCP: ``dcp.load`` into the live state dict (in place) of the newest save in RAM (tmpfs) and on disk.
    """
    from lightning_resilience.checkpoint import CheckpointManager, LocalTier

    def apply(state: dict[str, Any]) -> float:
        t0 = pc()
        wl.model.load_state_dict(state["model"])
        wl.opt.load_state_dict(state["optim"])
        return pc() - t0

    def ours_disk(cold: bool) -> tuple[float, float]:
        fresh = CheckpointManager([LocalTier(root, every_n_steps=DISK_EVERY)])
        fresh.setup()
        if cold:
            evict_page_cache(root)
        t0 = pc()
        res = fresh.restore()
        dt = pc() - t0
        fresh.close()
        if res is None or res.tier != "local":
            raise RuntimeError(f"expected a restore from the local tier, got {res and res.tier}")
        return dt, apply(res.state)

    def ours_ram(step: int) -> tuple[float, float]:
        ours.mgr.on_step(step, wl.state)
        ours.mgr.wait_snapshot()
        ours.mgr.wait()
        gc.collect()
        t0 = pc()
        res = ours.mgr.restore()
        dt = pc() - t0
        if res is None or res.tier != "memory" or res.step != step:
            raise RuntimeError(f"expected step {step} from the memory tier, got {res and (res.step, res.tier)}")
        return dt, apply(res.state)

    def dcp_load(path: Path, cold: bool) -> tuple[float, float]:
        assert dcp is not None
        if cold:
            evict_page_cache(path)
        state = wl.state()
        t0 = pc()
        dcp.dcp.load(state, checkpoint_id=path)
        dt = pc() - t0
        return dt, apply(state)

    cases: dict[str, Any] = {"ours_ram": lambda i: ours_ram(10**7 + 2 * i + 1)}
    cases["ours_disk_warm"] = lambda i: ours_disk(cold=False)
    cases["ours_disk_cold"] = lambda i: ours_disk(cold=True)
    if dcp is not None:
        for where in ("ram", "disk"):
            path = dcp.newest(where)
            if path is not None:
                cases[f"dcp_{where}" if where == "ram" else "dcp_disk_warm"] = lambda i, p=path: dcp_load(p, False)
                if where == "disk":
                    cases["dcp_disk_cold"] = lambda i, p=path: dcp_load(p, True)
    ours_disk(cold=False)  # the first read after the writes: not a figure
    raw: dict[str, dict[str, list[float]]] = {k: {"restore": [], "apply": []} for k in cases}
    for i in range(reps):
        for name, case in cases.items():
            gc.collect()
            read, applied = case(i)
            raw[name]["restore"].append(read)
            raw[name]["apply"].append(applied)
    out: dict[str, Any] = {}
    for name, r in raw.items():
        out[name] = {
            "restore": summarize(r["restore"]),
            "apply": summarize(r["apply"]),
            "total": summarize(a + b for a, b in zip(r["restore"], r["apply"])),
        }
    print_flush(
        "[checkpoint] restore: " + ", ".join(f"{k} {v['total']['median_s'] * 1e3:.0f} ms" for k, v in out.items())
    )
    return out


def clean(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()
