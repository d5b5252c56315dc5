"""One launch of the scale benchmark: N gloo ranks under torchrun, a trivial model under Lightning DDP, fits with and
without the default preset interleaved, then the step agreement's latency on its own.

Usage: ``torchrun --standalone --nproc-per-node N -m benchmarks._scale_job --out DIR [--steps S] [--turns T]``;
rank r writes ``DIR/rank<r>.json``.

Per fit: the step period (batch start to batch start), the time spent inside the suite's callbacks' hooks on the
training thread per step (what the suite itself costs the step), the file descriptors of the process at mid-fit, and
the time from fit start to the first batch. Then, off Lightning: the latency of rounds of the step agreement (a
16-field vector) and of gathers to rank 0 of payloads of two sizes, for the latency model; and of a side group's
reductions of two integers, along the ranks' tree and by gloo's ring all-reduce, taking turns.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from lightning_resilience.collective import SideGroup
from lightning_resilience.lightning._step_path import StepPath
from lightning_resilience.lightning.coordination import Suite
from lightning_resilience.lightning.suite import build_suite, compose_resilience
from lightning_resilience.step.agreement import Op, TreeAgreement
from lightning_resilience.step.channels import Channels

HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_epoch_start",
)


class Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _reference_item(i: int, table: dict[int, Any]) -> int:
    return (i * 3) ^ len(table)


def reference_work() -> float:
    """A fixed piece of host work of the suite's kind (Python calls, small containers, tiny tensor ops), timed on the
    calling thread's CPU clock: what the same code costs this process at this N, whatever the contention."""
    start = time.thread_time()
    table: dict[int, Any] = {}
    for i in range(400):
        table[i % 17] = _reference_item(i, table)
        if i % 8 == 0:
            table[i % 5] = torch.zeros(4).add_(i).tolist()
    return time.thread_time() - start


class Clock(Callback):
    """Step periods and the time to the first batch; the process's descriptors at mid-fit; the reference work's CPU
    time at every step (the same work at every N: how much slower the machine's contention makes host code)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.starts: list[float] = []
        self.reference: dict[int, float] = {}
        self.fit_start = 0.0
        self.fds = 0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.fit_start = time.perf_counter()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.reference[trainer.global_step] = reference_work()
        self.starts.append(time.perf_counter())
        if trainer.global_step == self.steps // 2:
            self.fds = len(os.listdir("/proc/self/fd"))


def _preemptions() -> int:
    """Involuntary context switches of the calling thread so far (the scheduler took its core away)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


class Spent:
    """The suite's time on the training thread per step: wall-clock (what the step waits, including the time the
    thread is descheduled), the thread's CPU time (what the suite's code costs, whatever else runs) and how often the
    scheduler took the thread's core away inside the suite's hooks (after each, the code runs on cold caches)."""

    def __init__(self, *, count: bool = False) -> None:
        self.wall: dict[int, float] = {}
        self.cpu: dict[int, float] = {}
        self.preempted: dict[int, int] = {}
        self.calls: dict[int, int] = {}
        self.count = count
        """Count the Python and C calls the suite makes instead (a fit of its own: the profiler slows it)."""
        self.trainer: Trainer | None = None

    def wrap(self, original: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            calls = [0]
            if self.count:

                def profile(frame: Any, event: str, arg: Any) -> None:
                    if event in ("call", "c_call"):
                        calls[0] += 1

                sys.setprofile(profile)  # this thread only: the agreement and persist threads are not counted
            switched = _preemptions()  # outside the timed span: the reading costs a system call
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
                switched = _preemptions() - switched
                if self.count:
                    sys.setprofile(None)
                if self.trainer is not None:
                    step = self.trainer.global_step
                    self.wall[step] = self.wall.get(step, 0.0) + wall
                    self.cpu[step] = self.cpu.get(step, 0.0) + cpu
                    self.preempted[step] = self.preempted.get(step, 0) + switched
                    self.calls[step] = self.calls.get(step, 0) + calls[0]

        return timed


_SPENT: list[Spent] = [Spent()]
"""The suite's times of the fit under way."""


def _timed(callbacks: list[Callback], spent: Spent) -> None:
    """Wrap every training-loop hook of the suite's callbacks so its time is added to the step it ran in."""
    for cb in callbacks:
        for name in HOOKS:
            setattr(cb, name, spent.wrap(getattr(cb, name)))


def _time_step_path() -> None:
    """The suite's own callback (the step driver's Lightning hooks) is added at fit start: its class's hooks are
    wrapped once, each call timed into the fit under way's :class:`Spent`."""
    for name in ("on_train_batch_start", "on_train_batch_end"):
        original = getattr(StepPath, name)

        def hook(self: StepPath, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            return _SPENT[0].wrap(_original)(self, *args, **kwargs)

        setattr(StepPath, name, hook)


def fit_once(suite: bool, steps: int, world: int, run_dir: Path, *, count: bool = False) -> dict[str, Any]:
    seed_everything(0)
    data = TensorDataset(torch.randn(64 * world, 8), torch.randn(64 * world, 1))
    clock = Clock(steps)
    callbacks: list[Callback] = [clock]
    spent = Spent(count=count)
    ours: list[Callback] = []
    if suite:
        node = compose_resilience(["+resilience=default", f"++resilience.run_dir={run_dir}"])
        ours = build_suite(node)
        callbacks += ours
    trainer = Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        callbacks=callbacks,
        default_root_dir=str(run_dir),
        logger=False,
        enable_checkpointing=suite,  # the suite's TieredCheckpoint is a Checkpoint: no default ModelCheckpoint then
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    spent.trainer = trainer
    if suite:  # the members' own hooks, and the suite's step path (the step driver's hooks)
        _timed(ours, spent)
        _SPENT[0] = spent
    start = time.perf_counter()
    trainer.fit(Tiny(), DataLoader(data, batch_size=4, shuffle=True))
    wall = time.perf_counter() - start
    out: dict[str, Any] = {
        "suite": suite,
        "periods_s": [b - a for a, b in zip(clock.starts, clock.starts[1:])],
        "first_batch_s": (clock.starts[0] - clock.fit_start) if clock.starts else None,
        "fds": clock.fds,
        "reference_cpu_s_by_step": {str(k): v for k, v in sorted(clock.reference.items())},
        "wall_s": wall,
    }
    if suite:
        s = Suite.of(trainer)
        assert s.driver is not None
        out["driver_ms_per_step"] = s.driver.stats.per_step_ms()
        out["driver_s_by_step"] = {str(k): v for k, v in s.driver.stats.recent}
        out["suite_s_by_step"] = {str(k): v for k, v in sorted(spent.wall.items())}
        out["suite_cpu_s_by_step"] = {str(k): v for k, v in sorted(spent.cpu.items())}
        out["suite_preempted_by_step"] = {str(k): v for k, v in sorted(spent.preempted.items())}
        out["suite_calls_by_step"] = {str(k): v for k, v in sorted(spent.calls.items())}
        stats = s.driver.agreement.stats
        out["agreement"] = {"rounds": stats.rounds, "late": stats.waits, "waited_s": stats.waited_seconds}
    return out


def _rounds(kind: str, count: int, size: int) -> list[float]:
    """Latency of ``count`` sequential rounds (issue, then wait) of the step agreement."""
    group = SideGroup("bench", timedelta(seconds=120), transport="tcp")  # the step agreement's transport
    tree = TreeAgreement(group)
    lat = []
    try:
        for i in range(count):
            dist.barrier()
            start = time.perf_counter()
            if kind == "reduce":
                tree.reduce([i] * size, [Op.MAX] * size, op="bench.reduce", step=i).result()
            else:
                tree.gather(b"x" * size, op="bench.gather", step=i).result()
            lat.append(time.perf_counter() - start)
    finally:
        tree.close()
        group.close()
    return lat


def _side_reductions(count: int) -> dict[str, list[float]]:
    """Latency of ``count`` reductions of two int64 each way, taking turns: the suite's side group's (a view of the
    ``suite`` group of :class:`Channels`, carried along the step agreement's tree) and gloo's ring all-reduce on a
    gloo group of its own (what the side groups did before)."""
    channels = Channels([timedelta(seconds=120)], timedelta(seconds=120))
    side = channels.side("bench.side", timedelta(seconds=120))
    ring = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    lat: dict[str, list[float]] = {"tree": [], "ring": []}
    try:
        for i in range(-1, count):  # the first of each connects its peers: not counted
            for way in ("tree", "ring") if i % 2 == 0 else ("ring", "tree"):
                dist.barrier()
                start = time.perf_counter()
                if way == "tree":
                    side.reduce_max_each([i, -i], op="bench.side", step=i)
                else:
                    dist.all_reduce(torch.tensor([i, -i], dtype=torch.int64), op=dist.ReduceOp.MAX, group=ring)
                if i >= 0:
                    lat[way].append(time.perf_counter() - start)
    finally:
        channels.close()
    return lat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    out = Path(args.out)
    _time_step_path()
    fits = []
    for turn in range(args.turns):
        for suite in (False, True) if turn % 2 == 0 else (True, False):
            fits.append({"turn": turn, **fit_once(suite, args.steps, world, out / f"run{turn}")})
    counted = fit_once(True, args.steps, world, out / "counted", count=True)
    result = {
        "rank": rank,
        "calls_by_step": counted["suite_calls_by_step"],
        "world": world,
        "fits": fits,
        "reduce_s": _rounds("reduce", args.rounds, 16),
        "gather_small_s": _rounds("gather", args.rounds, 256),
        "gather_large_s": _rounds("gather", args.rounds, 16384),
        "fds_end": len(os.listdir("/proc/self/fd")),
        "side_reduce_s": _side_reductions(args.rounds),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    median = statistics.median(result["reduce_s"])
    if rank == 0:
        print(f"scale job: {world} ranks, round median {median * 1e3:.2f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
