"""The default SDC preset's step-time overhead on one device: the GPU check's SDC part (``benchmarks.gpu_check``).

On the CPU the guards' norms, a replay's recompute and the state's digests take the cores the step runs on; on a GPU
they are device work queued behind the step's own, and their values reach the host late, without a wait. Only a
device says what that costs. One process, one device (no replica to reconcile with: the reconciliation's digest of
the state is timed apart, as a cost per check), the preset's monitor exactly as ``configs/resilience/sdc`` builds
it, driven by the suite's step driver, deterministic algorithms on (the preset compares replays bitwise) in all arms.

Three arms take turns in windows of ``window`` steps (A B B A), each with its own replica from the same initial
state: the monitored loop; a **plain** loop (no monitor, no driver); and the **floor**, the plain loop plus the same
arithmetic at the same cadences (the gradient norm every step, the parameter norm at its cadence, a replay's forward
and backward with its gradients' digest at the replay cadence) with none of the bookkeeping. Step times are CUDA
events on the training stream (host wall time on the CPU). At one rank the gradient-norm guard runs every step; with
``guard_grad_norm_stride`` ranks or more each rank runs it on one step in that many.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import fmt_pct, mean_interval, slowdowns
from benchmarks._sdc.rank import Decisions, Floor
from benchmarks._sdc.trials import preset_config
from benchmarks._workload import GPTWorkload, StepClock

__all__ = ["describe", "device_overhead", "run"]

_DTYPES = {"bf16": torch.bfloat16, "fp32": None}
_CUBLAS = ":4096:8"


def device_overhead(
    model_kwargs: dict[str, Any],
    *,
    device: str = "cuda",
    dtype: str = "bf16",
    batch_size: int = 2,
    windows: int = 20,
    window: int = 10,
    warm: int = 10,
    preset: str = "default",
    scale: int | None = None,
) -> dict[str, Any]:
    """The monitored arm against the plain one and the floor, ``windows`` windows of ``window`` steps each after
    ``warm`` steps of each arm; ``scale`` shortens the preset's cadences (a smoke run)."""
    from lightning_resilience.policy import PolicyConfig
    from lightning_resilience.sdc.monitor import SDCMonitor
    from lightning_resilience.sdc.verdict import Diagnosis
    from lightning_resilience.step.channels import Channels
    from lightning_resilience.step.driver import StepDriver

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if device.startswith("cuda") and os.environ.get("CUBLAS_WORKSPACE_CONFIG") != _CUBLAS:
        raise RuntimeError(f"deterministic cuBLAS needs CUBLAS_WORKSPACE_CONFIG={_CUBLAS} before the process starts")
    torch.use_deterministic_algorithms(True)
    cfg = preset_config(preset, scale)
    arms = {
        k: GPTWorkload(model_kwargs, batch_size, device=device, dtype=_DTYPES[dtype])
        for k in ("checked", "plain", "floor")
    }
    checked = arms["checked"]
    monitor = SDCMonitor(list(checked.model.named_parameters()), [checked.opt], cfg)
    monitor.setup()
    monitor.attach(checked.model.compute_loss)
    channels = Channels([cfg.timeout], timedelta(seconds=300), local=True)
    driver = StepDriver(PolicyConfig(), channels.agreement)
    driver.add_contributor(monitor)
    monitor.driven = True
    actor = Decisions()  # no state to restore: a decision on this clean run is recorded, and counted
    floor = arms["floor"]  # its checks at one rank: the gradient norm every step; the state's digest timed apart
    floor_checks = Floor(cfg, floor.model, floor.opt, sched=floor.sched, reconcile=False)

    def checked_step(i: int, batch: torch.Tensor) -> None:
        driver.begin_step(i)
        monitor.begin_step(i, batch)
        loss = checked.model.compute_loss(batch)
        monitor.observe_loss(loss)
        loss.backward()
        monitor.before_optimizer_step()
        checked.opt.step()
        checked.opt.zero_grad(set_to_none=True)
        checked.sched.step()
        monitor.after_optimizer_step()
        driver.end_step(i + 1, actor)

    def plain_step(i: int, batch: torch.Tensor) -> None:
        del i
        plain = arms["plain"]
        loss = plain.model.compute_loss(batch)
        loss.backward()
        plain.opt.step()
        plain.opt.zero_grad(set_to_none=True)
        plain.sched.step()

    run: dict[str, Callable[[int, torch.Tensor], Any]] = {
        "checked": checked_step,
        "plain": plain_step,
        "floor": floor_checks.step,
    }
    times: dict[str, list[float]] = {k: [] for k in run}
    clock = StepClock(device)
    started = time.perf_counter()
    for kind, step in run.items():  # warm: allocations, kernels chosen, the guards' baselines
        for i in range(warm):
            step(i, arms[kind].batches[i % len(arms[kind].batches)])
    stats0 = (monitor.stats.replay_rounds, monitor.stats.replay_seconds, monitor.stats.guard_seconds)
    driver0 = sum(driver.stats.seconds.values())
    i = warm
    for r in range(windows):
        for kind in ("checked", "plain", "floor") if r % 2 == 0 else ("floor", "plain", "checked"):
            batches = arms[kind].batches
            clock.mark()
            for k in range(window):
                run[kind](i + k, batches[(i + k) % len(batches)])
                clock.mark()
            times[kind] += clock.intervals()
        i += window
    digest_s = []  # what a reconciliation's digest of the local state costs, read to the host as the check reads it
    for _ in range(3):
        t0 = time.perf_counter()
        floor_checks.state.local()
        digest_s.append(time.perf_counter() - t0)
    channels.close()
    n = len(times["checked"])
    plain_mean = statistics.fmean(times["plain"])
    pairs = [statistics.fmean(times["checked"][j : j + window]) / statistics.fmean(times["plain"][j : j + window]) - 1
             for j in range(0, n, window)]  # fmt: skip
    interval = mean_interval(pairs)
    rounds = monitor.stats.replay_rounds - stats0[0]
    digest_check_s = statistics.median(digest_s)
    return {
        "device": device,
        "dtype": dtype,
        "params": sum(p.numel() for p in checked.model.parameters()),
        "batch_size": batch_size,
        "seq_len": model_kwargs["seq_len"],
        "preset": preset,
        "cadences": {
            k: getattr(cfg, k)
            for k in ("replay_every_n_steps", "reconcile_every_n_steps", "param_norm_every_n_steps", "guard_read_lag")
        },
        "steps_each": n,
        "window_steps": window,
        "plain_step_mean_s": plain_mean,
        "checked_step_mean_s": statistics.fmean(times["checked"]),
        **slowdowns(times["checked"], times["plain"]),
        "per_pair_mean": interval[0] if interval else None,
        "per_pair_interval95": list(interval[1:]) if interval else None,
        "floor_slowdown_mean": statistics.fmean(times["floor"]) / plain_mean - 1.0,
        "beyond_floor_mean": statistics.fmean(times["checked"]) / statistics.fmean(times["floor"]) - 1.0,
        "replay_rounds": rounds,
        "replay_s_per_round": (monitor.stats.replay_seconds - stats0[1]) / rounds if rounds else None,
        "guard_host_s_per_step": (monitor.stats.guard_seconds - stats0[2]) / n,
        "driver_host_s_per_step": (sum(driver.stats.seconds.values()) - driver0) / n,
        "guard_forced_reads": monitor.reader.forced_reads,
        "reconcile_digest_s": digest_check_s,
        "reconcile_share": digest_check_s / (cfg.reconcile_every_n_steps * plain_mean)
        if cfg.reconcile_every_n_steps
        else None,
        "decisions_on_a_clean_run": [f"{d.action.value}:{d.event.value}" for d in actor.decisions],
        "verdicts_on_a_clean_run": [e.to_json() for e in monitor.events if e.verdict is not Diagnosis.CLEAN],
        "wall_s": time.perf_counter() - started,
        "samples_s": times,
    }


def describe(o: dict[str, Any]) -> str:
    """The GPU check's line for this part."""
    lo_hi = o.get("per_pair_interval95")
    interval = f" (95% interval {fmt_pct(lo_hi[0])} to {fmt_pct(lo_hi[1])} over windows)" if lo_hi else ""
    digest = o["reconcile_digest_s"] * 1e3
    return (
        f"SDC, the `{o['preset']}` preset on the device: {o['params'] / 1e6:,.1f}M parameters ({o['dtype']}), batch "
        f"{o['batch_size']} x {o['seq_len']}, deterministic algorithms in every arm, {o['steps_each']} steps an arm "
        f"in windows of {o['window_steps']}: mean step {o['plain_step_mean_s'] * 1e3:.1f} ms plain, "
        f"{o['checked_step_mean_s'] * 1e3:.1f} ms monitored: **{fmt_pct(o['slowdown_mean'])}** mean{interval}, "
        f"p99 {fmt_pct(o['slowdown_p99'])}; the floor (the same arithmetic, no bookkeeping) "
        f"{fmt_pct(o['floor_slowdown_mean'])}. {o['replay_rounds']} replay round(s); on the host the guards took "
        f"{o['guard_host_s_per_step'] * 1e3:.2f} ms a step and the driver {o['driver_host_s_per_step'] * 1e3:.2f} ms "
        f"({o['guard_forced_reads']} forced read(s)). One rank has no replica to reconcile with: the state's digest "
        f"for a reconciliation takes {digest:.1f} ms a check, "
        f"{fmt_pct(o['reconcile_share'])} of the step at one check every "
        f"{o['cadences']['reconcile_every_n_steps']} steps. Decisions on this clean run: "
        f"{len(o['decisions_on_a_clean_run'])}, verdicts {len(o['verdicts_on_a_clean_run'])}."
    )


def run(out: Path, *, smoke: bool, batch_size: int, windows: int, timeout_s: float) -> dict[str, Any]:
    """:func:`device_overhead` of the 1B model in a process of its own (deterministic algorithms and cuBLAS's
    workspace set for it alone, its device memory given back when it ends); ``smoke``: the tiny model on the CPU,
    short (``batch_size`` and ``windows`` are the smoke run's own)."""
    cmd = [sys.executable, "-m", "benchmarks._sdc.device", "--out", str(out), "--batch-size", str(batch_size),
           "--windows", str(windows), *(["--smoke"] if smoke else [])]  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": _CUBLAS, "PYTHONPATH": str(root)}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the SDC device run failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return dict(json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks._sdc.device", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--batch-size", type=int, default=2, help="sequences of 2048 tokens a step")
    p.add_argument("--windows", type=int, default=20, help="windows of 10 steps an arm")
    p.add_argument("--smoke", action="store_true", help="the tiny model on the CPU: 1 sequence, 2 windows of 3 steps")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    from benchmarks import checkpoint

    size = argparse.Namespace(preset="tiny" if args.smoke else "1b", d_model=None, n_layer=None, seq_len=None)
    if args.smoke:  # the cadences at 5 steps, so that a replay lands in the run
        result = device_overhead(checkpoint.model_config(size), device="cpu", dtype="fp32", batch_size=1, windows=2,
                                 window=3, warm=3, scale=5)  # fmt: skip
    else:
        result = device_overhead(checkpoint.model_config(size), batch_size=args.batch_size, windows=args.windows)
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
