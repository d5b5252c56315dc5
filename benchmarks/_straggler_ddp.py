"""Real multi-process straggler drills: run under torchrun, each trial one Lightning ``fit`` with DDP (or FSDP2) on
CPU ranks (gloo), a plain ``DataLoader(shuffle=True)`` and the default ``StragglerDetection()``.

Usage (2 ranks, three trials in one launch)::

    torchrun --nproc-per-node 2 -m benchmarks._straggler_ddp --out DIR \\
        --trial compute:1:1.5:40:60 --trial data:1:1.5:40:60 --trial job:-1:1.5:45:70

A trial is ``kind:rank:factor:onset:steps[:strategy]`` (strategy ``ddp``, the default, or ``fsdp``: FSDP2
``fully_shard`` of every linear layer through Lightning's ``ModelParallelStrategy``):

* ``compute``: from step ``onset`` rank ``rank`` sleeps inside its forward (``training_step``) for
  ``(factor - 1) x`` the job's step period (median of the 20 periods before the onset, measured here, apart from
  the detector): a throttled device. Its own work becomes at least ``factor`` x as long; the others wait for it in
  the gradient all-reduce.
* ``data``: the same delay in the rank's data loader (its ``collate_fn``): a slow data path on one node.
* ``job``: every rank's forward is slowed so: a job-wide slowdown.
* ``clean``: nothing is slowed. ``plain``: clean, and without the detector (the overhead baseline). ``path``: clean,
  with the suite's step path but no detector (``ResiliencePolicy()`` alone: the step driver and its one agreement
  per step), which tells the detector's own share of the overhead from the step path's that every preset has.
* ``toggle``: clean, with the detector on for ``onset`` steps, then off for as many (its hooks and its step end
  skipped: the step path alone), and so on; ``rank`` 0 starts on, 1 starts off. Steps on and off are neighbours in
  one process, so the machine's drift between launches cancels out of their difference (the detector's own share,
  paired). Off, the wait probes' forward pre-hooks stay registered and return at once (a few microseconds a step
  counted in both spans).

The sleep is deterministic and relative to the measured step, so noise from other processes on the machine hits
the slow and the fast ranks alike. Each rank writes ``DIR/rank<r>.json``: per trial the actual onset (the first
step whose work included an injected delay), the verdicts, noise-level confirmations and decisions, the
per-exchange times and scores, and the step periods (for the overhead).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset, default_collate

from lightning_resilience.lightning.callbacks.policy import ResiliencePolicy
from lightning_resilience.lightning.callbacks.straggler import StragglerDetection
from lightning_resilience.lightning.coordination import Suite

KINDS = ("compute", "data", "job", "clean", "plain", "path", "toggle")
STRATEGIES = ("ddp", "fsdp")
PERIOD_WINDOW = 20


@dataclass(frozen=True)
class Trial:
    kind: str
    rank: int
    factor: float
    onset: int
    steps: int
    strategy: str = "ddp"

    @classmethod
    def parse(cls, text: str) -> Trial:
        kind, rank, factor, onset, steps, *rest = text.split(":")
        if kind not in KINDS:
            raise ValueError(f"trial kind must be one of {KINDS}, got {kind!r}")
        strategy = rest[0] if rest else "ddp"
        if strategy not in STRATEGIES:
            raise ValueError(f"trial strategy must be one of {STRATEGIES}, got {strategy!r}")
        return cls(kind, int(rank), float(factor), int(onset), int(steps), strategy)


@dataclass
class _Injection:
    """What this process injects; shared by the model (compute), the collate function (data) and the drill."""

    compute_delay: float = 0.0
    data_delay: float = 0.0
    injected: int = 0
    """Delays injected so far (the drill reads it to find the first slowed step)."""

    def pause(self, seconds: float) -> None:
        if seconds > 0:
            threading.Event().wait(seconds)  # a deterministic stall: no CPU burnt that the other rank would miss
            self.injected += 1


class _Collate:
    def __init__(self, injection: _Injection) -> None:
        self.injection = injection

    def __call__(self, samples: list[Any]) -> Any:
        self.injection.pause(self.injection.data_delay)
        return default_collate(samples)


class _Mlp(LightningModule):
    """An MLP; with ``device_s`` its forward also waits that long, as a host waits for an accelerator's kernels
    (CPU contention from other jobs on a shared machine then barely moves the step)."""

    def __init__(
        self, width: int, depth: int, injection: _Injection, device_s: float = 0.0, fsdp: bool = False
    ) -> None:
        super().__init__()
        self.device_s, self.fsdp = device_s, fsdp
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
        self.register_buffer("target_scale", torch.ones(1))  # a buffer: DDP broadcasts it before every forward
        self.injection = injection

    def configure_model(self) -> None:
        if self.fsdp:  # FSDP2: every linear layer its own unit, then the root
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y * self.target_scale)
        if self.device_s > 0:
            threading.Event().wait(self.device_s)
        self.injection.pause(self.injection.compute_delay)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


class _Drill(Callback):
    """Measures the step period and arms the injection at the onset; records the first slowed step, in the
    detector's numbering (``trainer.global_step`` at the end of the step)."""

    def __init__(self, trial: Trial, injection: _Injection) -> None:
        self.trial, self.injection = trial, injection
        self.starts: list[float] = []
        self.onset: int | None = None
        self.delay = 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())
        t = self.trial
        if trainer.global_step != t.onset or t.kind not in ("compute", "data", "job"):
            return
        periods = [b - a for a, b in zip(self.starts[-PERIOD_WINDOW - 1 : -1], self.starts[-PERIOD_WINDOW:])]
        self.delay = (t.factor - 1.0) * statistics.median(periods)
        if t.kind == "data" and trainer.global_rank == t.rank:
            self.injection.data_delay = self.delay  # from the next fetch on
        elif t.kind == "job" or (t.kind == "compute" and trainer.global_rank == t.rank):
            self.injection.compute_delay = self.delay

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self.onset is None and self.injection.injected:  # this step's work or its data wait was slowed
            self.onset = trainer.global_step


class _TimedDetection(StragglerDetection):
    """The default callback, with the time spent inside its per-step hooks accumulated (``spent_s``)."""

    spent_s = 0.0
    spent_cpu_s = 0.0
    """The training thread's CPU inside the hooks: below ``spent_s`` by what it waited there (for the interpreter,
    for a core)."""

    def _timed(self, hook: Any, *args: Any) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        hook(*args)
        self.spent_s += time.perf_counter() - t0
        self.spent_cpu_s += time.thread_time() - c0

    def on_train_batch_start(self, *args: Any) -> None:
        self._timed(super().on_train_batch_start, *args)

    def on_before_backward(self, *args: Any) -> None:
        self._timed(super().on_before_backward, *args)

    def on_after_backward(self, *args: Any) -> None:
        self._timed(super().on_after_backward, *args)

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._timed(super().on_before_optimizer_step, *args)

    def on_train_batch_end(self, *args: Any) -> None:
        self._timed(super().on_train_batch_end, *args)


class _ToggledDetection(_TimedDetection):
    """The default callback, on for ``span`` steps and off for as many (``toggle`` trials): off, none of its hooks
    nor its step end runs, so the step has the suite's step path alone; ``on`` records which steps had it."""

    def __init__(self, span: int, start_on: bool) -> None:
        super().__init__()
        self.span, self.start_on = span, start_on
        self.active = True
        self.on: list[bool] = []

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        active = ((trainer.global_step // self.span) % 2 == 0) == self.start_on
        if active and not self.active and self.detector is not None:
            self.detector.timer.reset_data_wait()  # the steps off are not a wait for data
        self.active = active
        self.on.append(active)
        super().on_train_batch_start(trainer, *args)

    def _timed(self, hook: Any, *args: Any) -> None:  # every per-step hook comes through here
        if self.active:
            super()._timed(hook, *args)

    def finish_step(self, step: int) -> None:
        if self.active:
            super().finish_step(step)

    def after_step(self, step: int, decision: Any) -> None:
        if self.active:
            super().after_step(step, decision)


def _driver_seconds(trainer: Trainer) -> float:
    """The step driver's time on the training thread over the fit (its round's issue, the detector's step end, the
    agreement taken): the suite's per-step work beside the callback's own hooks."""
    driver = Suite.of(trainer).driver
    return sum(driver.stats.seconds.values()) if driver is not None else 0.0


def run_trial(trial: Trial, args: argparse.Namespace, index: int) -> dict[str, Any]:
    seed_everything(args.seed + index, workers=True)
    injection = _Injection()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n = args.batch * (trial.steps + 4) * world
    gen = torch.Generator().manual_seed(args.seed + index)
    data = TensorDataset(torch.randn(n, args.width, generator=gen), torch.randn(n, 1, generator=gen))
    loader = DataLoader(data, batch_size=args.batch, shuffle=True, collate_fn=_Collate(injection))
    drill = _Drill(trial, injection)
    detection: _TimedDetection | None = None
    if trial.kind == "toggle":
        detection = _ToggledDetection(trial.onset, start_on=trial.rank == 0)
    elif trial.kind not in ("plain", "path"):
        detection = _TimedDetection()
    callbacks: list[Callback] = [drill] + ([detection] if detection is not None else [])
    if trial.kind == "path":
        callbacks.append(ResiliencePolicy())
    trainer = Trainer(
        max_steps=trial.steps,
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp"
        if trial.strategy == "ddp"
        else ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    started, before = time.perf_counter(), os.times()
    trainer.fit(_Mlp(args.width, args.depth, injection, args.device_ms / 1e3, trial.strategy == "fsdp"), loader)
    after = os.times()  # the fit's children are reaped by now: rank 0's scoring process, closed at the fit's end
    out: dict[str, Any] = {
        "trial": asdict(trial),
        "rank": trainer.global_rank,
        "world": trainer.world_size,
        "onset": drill.onset,
        "delay_s": drill.delay,
        "periods_s": [b - a for a, b in zip(drill.starts, drill.starts[1:])],
        "wall_s": time.perf_counter() - started,
        "children_cpu_s": after.children_user + after.children_system - before.children_user - before.children_system,
    }
    if trial.kind == "path":
        out["driver_s_per_step"] = _driver_seconds(trainer) / max(1, trial.steps)
    if isinstance(detection, _ToggledDetection):
        out["on"] = detection.on  # per batch: whether the detector ran (the period after that batch's start)
    if detection is not None and detection.detector is not None:
        det = detection.detector
        out.update(
            {
                "parallelism": detection.parallelism,
                "detector_s_per_step": detection.spent_s / max(1, trial.steps),
                "detector_cpu_s_per_step": detection.spent_cpu_s / max(1, trial.steps),
                "exchange_s_per_step": det.gather_seconds / max(1, trial.steps),
                "driver_s_per_step": _driver_seconds(trainer) / max(1, trial.steps),
                "verdicts": [v.to_dict() for v in det.verdicts],
                "noise_level": [v.to_dict() for v in det.noise_level],
                "decisions": [d.to_dict() for d in det.decisions],
                "history": [(step, {k: v.tolist() for k, v in t.items()}) for step, t in det.history],
                "summary": detection.summary(),
                "report": det.report(),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for rank<r>.json")
    p.add_argument(
        "--trial", action="append", type=Trial.parse, required=True, help="kind:rank:factor:onset:steps[:ddp|fsdp]"
    )
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--device-ms", type=float, default=0.0, help="simulated device time per forward (ms)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # one core per rank: ranks do not fight over each other's cores
    results = [run_trial(trial, args, i) for i, trial in enumerate(args.trial)]
    rank = int(os.environ.get("RANK", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "trials": results}))
    return 0


if __name__ == "__main__":
    code = main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # results are written: skip interpreter finalisation (gloo threads can abort it)
