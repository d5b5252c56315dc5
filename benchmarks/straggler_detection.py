"""Straggler detection on real ranks: latency, precision, recall, false verdicts and overhead; plus a synthetic
cross-check at scale, labelled as such.

Run from the repository root, on a quiet machine (other jobs on the machine make real stragglers of their own)::

    python -m benchmarks.straggler_detection            # about 30 minutes on 2 cores
    python -m benchmarks.straggler_detection --quick    # smoke mode, about 2 minutes

**Real ranks** (the published figures). ``torchrun --standalone --nproc-per-node 2 -m benchmarks._straggler_ddp``:
every trial is a Lightning ``fit`` with ``strategy="ddp"`` on CPU ranks (gloo), a plain ``DataLoader(shuffle=True)``
and the default ``StragglerDetection()``, real clocks. In a slow trial one random rank becomes ``factor`` x slower
from a random onset, inside its forward (``compute``: a throttled device) or in its data loader (``data``: a slow
data path), by a deterministic stall of ``(factor - 1)`` x the job's measured step period. Two workloads:
``device`` (an MLP whose forward also waits a fixed 60 ms, as a host waits for an accelerator) and ``cpu`` (a larger
MLP, all real CPU compute; the machine's own noise reaches the ranks unfiltered). Per (workload, factor, component):

* latency: slow steps observed up to and including the first verdict naming the slow rank and component;
* recall: trials whose slow rank and component were named; precision: those first correct verdicts / all verdicts
  of the slow trials (a verdict on another rank, another component, or before the onset is false);
* false verdicts per 1,000 clean steps, from clean trials (which double as the "with detector" arm below);
* overhead: the mean step period with the detector against without it, in interleaved trials of the same launch
  (what the user feels), and the time spent inside the callback's hooks per step (what it costs). A third arm, the
  suite's step path alone (``ResiliencePolicy()``: the step driver and its one agreement a step, which every preset
  has), tells the detector's own share from the step path's.

**Synthetic** (a cross-check at scale, not the published claim): 8 simulated ranks feed the real detector through
fake clocks; every step, every rank waits in a modelled collective until the slowest rank arrives, so whole-step
times are equal across ranks as under DDP and only compute and data tell them apart.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import (
    REPO_ROOT,
    add_load_argument,
    check_load_at_start,
    command_line,
    cpu_counters,
    finish_load,
    fmt_pct,
    machine_info,
    now_iso,
    print_flush,
    summarize,
    target,
    write_json,
)
from benchmarks._straggler.render import f2, render_markdown
from benchmarks._straggler.scoring import WARM_STEPS, nvrx_rule, onset_of, periods_of, score_slow
from benchmarks._straggler.synthetic import synthetic
from lightning_resilience.straggler.config import StragglerConfig

__all__ = ["DEFAULT_OUT", "TITLE", "WARM_STEPS", "WORKLOADS", "launch_drills", "main", "render_markdown"]

MODULE = "benchmarks.straggler_detection"
DEFAULT_OUT = "benchmarks/results/straggler_detection.json"
TITLE = "Straggler detection: latency, precision, recall, false verdicts, overhead (real DDP ranks)"
README_PENDING = (
    "**straggler detection**, measured on real ranks (torchrun, 2 DDP CPU ranks, the default config, a rank slowed "
    "1.2x or 1.5x in its compute or its data loader): latency, recall, precision, false verdicts and overhead in "
    "[docs/benchmarks.md](docs/benchmarks.md) once `python -m benchmarks.straggler_detection` has run on a quiet "
    "machine; its synthetic cross-check (simulated ranks with a modelled all-reduce wait) is printed apart and is not "
    "a measurement. The real-DDP drill in CI names a 1.5x compute-slow, data-slow and FSDP2 rank, and a job-wide "
    "slowdown, within 10 steps."
)
"""The README's line while no result is recorded (run_all writes it)."""

REAL_FACTORS = (1.2, 1.5)
KINDS = ("compute", "data")
AB_ARMS = ("clean", "path", "plain")
"""The overhead's arms: with the detector, the suite's step path alone (``ResiliencePolicy()``), nothing."""
TARGET_LATENCY = {1.2: 20, 1.5: 10}  # slow steps, on real ranks
TARGET_FALSE_PER_1K = 0.0
TARGET_OVERHEAD = 0.005
WORKLOADS = {  # name -> arguments of benchmarks._straggler_ddp
    "device": ["--width", "256", "--depth", "4", "--batch", "64", "--device-ms", "60"],
    "cpu": ["--width", "1024", "--depth", "4", "--batch", "64"],
}

pc = time.perf_counter


# ------------------------------------------------------------------------------------------------ real ranks
def launch_drills(trials: list[str], workload: str, args: argparse.Namespace, out: Path) -> list[list[dict[str, Any]]]:
    """One torchrun launch; per trial, every rank's result."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world),
        "-m", "benchmarks._straggler_ddp", "--out", str(out), "--seed", str(args.seed), *WORKLOADS[workload],
        *[arg for t in trials for arg in ("--trial", t)],
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=args.launch_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"straggler drill launch failed ({proc.returncode}): {proc.stderr[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text())["trials"] for r in range(args.world)]
    return [[ranks[r][i] for r in range(args.world)] for i in range(len(trials))]


def real_ddp(args: argparse.Namespace, workload: str) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    slow: list[tuple[float, str, str]] = []
    for factor in REAL_FACTORS:
        for kind in KINDS:
            for _ in range(args.trials):
                onset = int(rng.integers(args.onset_min, args.onset_max + 1))
                spec = f"{kind}:{int(rng.integers(args.world))}:{factor}:{onset}:{onset + args.post_steps}"
                slow.append((factor, kind, spec))
        for _ in range(args.job_trials if factor == 1.5 else 0):
            onset = int(rng.integers(args.onset_min, args.onset_max + 1))
            slow.append((factor, "job", f"job:-1:{factor}:{onset}:{onset + args.post_steps}"))
    for kind in KINDS:  # FSDP2 (fully_shard through ModelParallelStrategy), at 1.5x
        for _ in range(args.fsdp_trials):
            onset = int(rng.integers(args.onset_min, args.onset_max + 1))
            spec = f"{kind}:{int(rng.integers(args.world))}:1.5:{onset}:{onset + args.post_steps}:fsdp"
            slow.append((1.5, f"{kind}/fsdp", spec))
    order = rng.permutation(len(slow))  # kinds and factors interleaved: drift of the machine hits them alike
    slow = [slow[i] for i in order]
    ab = []
    arms = [f"{kind}:-1:1.0:0:{args.ab_steps}" for kind in AB_ARMS]
    for block in range(args.ab_blocks):  # with the detector / the step path alone / plain; each goes first in turn
        ab += arms[block % len(arms) :] + arms[: block % len(arms)]
    t0 = pc()
    print_flush(f"[straggler] {workload}: {len(slow)} slow trials, {len(ab)} interleaved clean / path / plain trials")
    with tempfile.TemporaryDirectory() as tmp:
        results = launch_drills([s for _, _, s in slow] + ab, workload, args, Path(tmp))
    slow_results, ab_results = results[: len(slow)], results[len(slow) :]
    groups: dict[str, Any] = {}
    for factor in REAL_FACTORS:
        for kind in KINDS:
            res = [r for (f, k, _), r in zip(slow, slow_results) if f == factor and k == kind]
            groups[f"{kind}@{factor}"] = {"factor": factor, "kind": kind, **score_slow(res)}
            groups[f"{kind}@{factor}"]["nvrx_rule"] = {sec: nvrx_rule(res, sec) for sec in ("step", kind)}
    for kind in KINDS if args.fsdp_trials else ():
        res = [r for (_, k, _), r in zip(slow, slow_results) if k == f"{kind}/fsdp"]
        groups[f"{kind}@1.5/fsdp"] = {"factor": 1.5, "kind": f"{kind} (FSDP2)", **score_slow(res)}
    job = [r for (_, k, _), r in zip(slow, slow_results) if k == "job"]
    job_latency = []
    job_false = 0
    for res in job:
        onset, verdicts = onset_of(res), res[0]["verdicts"]
        good = [v for v in verdicts if v["scope"] == "job" and onset is not None and v["step"] >= onset]
        job_false += len([v for v in verdicts if v["scope"] != "job" or onset is None or v["step"] < onset])
        if good:
            job_latency.append(int(good[0]["step"]) - int(onset or 0) + 1)
    pre_onset_steps = sum(onset_of(r) or 0 for r in slow_results)
    pre_onset_false = sum(
        1 for r in slow_results for v in r[0]["verdicts"] if onset_of(r) is not None and v["step"] < (onset_of(r) or 0)
    )
    arm = {kind: [r for r in ab_results if r[0]["trial"]["kind"] == kind] for kind in AB_ARMS}
    clean, path = arm["clean"], arm["path"]
    clean_steps = sum(r[0]["trial"]["steps"] for r in clean)
    clean_verdicts = [v for r in clean for v in r[0]["verdicts"]]
    with_p, path_p, plain_p = (periods_of(arm[kind]) for kind in AB_ARMS)
    path_driver_s = [rank.get("driver_s_per_step", 0.0) for r in path for rank in r]
    hook_s = [rank["detector_s_per_step"] for r in clean for rank in r]
    exchange_s = [rank["exchange_s_per_step"] for r in clean for rank in r]
    driver_s = [rank.get("driver_s_per_step", 0.0) for r in clean for rank in r]
    # per block (the three arms side by side): the slowdowns, and how precisely the blocks pin them down
    blocks = [ab_results[i : i + len(AB_ARMS)] for i in range(0, len(ab_results), len(AB_ARMS))]
    means = [{r[0]["trial"]["kind"]: statistics.fmean(p) for r in block if (p := periods_of([r]))} for block in blocks]

    def per_block_of(kind: str, base: str) -> list[float]:
        return [m[kind] / m[base] - 1.0 for m in means if kind in m and base in m]

    per_block, per_block_path, per_block_own = (
        per_block_of("clean", "plain"), per_block_of("path", "plain"), per_block_of("clean", "path")
    )  # fmt: skip
    mean_with, mean_plain = statistics.fmean(with_p), statistics.fmean(plain_p)
    mean_path = statistics.fmean(path_p) if path_p else None
    step_median = statistics.median(plain_p)
    return {
        "workload": workload,
        "workload_args": WORKLOADS[workload],
        "world": args.world,
        "groups": groups,
        "job": {
            "trials": len(job),
            "named": len(job_latency),
            "latency_steps": job_latency,
            "latency_max": max(job_latency) if job_latency else None,
            "false_verdicts": job_false,
        },
        "clean": {
            "steps": clean_steps,
            "false_verdicts": len(clean_verdicts),
            "false_per_1k_steps": len(clean_verdicts) / clean_steps * 1000 if clean_steps else None,
            "verdicts": clean_verdicts[:10],
            "noise_level": sum(len(r[0]["noise_level"]) for r in clean),
            "pre_onset_steps": pre_onset_steps,
            "pre_onset_false_verdicts": pre_onset_false,
        },
        "overhead": {
            "step_period_plain": summarize(plain_p) | {"samples_s": []},
            "step_period_with_detector": summarize(with_p) | {"samples_s": []},
            "mean_fraction": mean_with / mean_plain - 1.0,
            "p99_fraction": float(np.percentile(with_p, 99)) / float(np.percentile(plain_p, 99)) - 1.0,
            "per_block": per_block,
            "step_period_path": summarize(path_p) | {"samples_s": []} if path_p else None,
            "path_mean_fraction": mean_path / mean_plain - 1.0 if mean_path else None,
            "path_per_block": per_block_path,
            "path_driver_s_per_step_mean": statistics.fmean(path_driver_s) if path_driver_s else None,
            "own_mean_fraction": mean_with / mean_path - 1.0 if mean_path else None,
            "own_p99_fraction": float(np.percentile(with_p, 99)) / float(np.percentile(path_p, 99)) - 1.0
            if path_p
            else None,
            "own_per_block": per_block_own,
            "hooks_s_per_step_mean": statistics.fmean(hook_s),
            "hooks_fraction": statistics.fmean(hook_s) / step_median,
            "driver_s_per_step_mean": statistics.fmean(driver_s),
            "training_thread_fraction": (statistics.fmean(hook_s) + statistics.fmean(driver_s)) / step_median,
            "exchange_latency_s_per_step_mean": statistics.fmean(exchange_s),
        },
        "wall_s": pc() - t0,
    }


# ------------------------------------------------------------------------------------------------------ driver
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke mode: few, short trials")
    p.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="real workloads (default: both)")
    p.add_argument("--world", type=int, default=2, help="real ranks (CPU processes)")
    p.add_argument("--trials", type=int, default=None, help="slow trials per factor and component (default 10)")
    p.add_argument("--job-trials", type=int, default=None, help="job-wide slowdown trials at 1.5x (default 4)")
    p.add_argument("--fsdp-trials", type=int, default=None, help="FSDP2 slow trials per component at 1.5x (default 4)")
    p.add_argument("--onset-min", type=int, default=40)
    p.add_argument("--onset-max", type=int, default=None, help="latest onset (default 70)")
    p.add_argument("--post-steps", type=int, default=None, help="steps after the onset (default 30)")
    p.add_argument("--ab-blocks", type=int, default=None, help="blocks of clean / path / plain trials (default 10)")
    p.add_argument("--ab-steps", type=int, default=None, help="steps per clean or plain trial (default 260)")
    p.add_argument("--synth-world", type=int, default=8)
    p.add_argument("--synth-trials", type=int, default=None, help="synthetic trials per factor (default 50)")
    p.add_argument("--synth-steps", type=int, default=300)
    p.add_argument("--synth-clean-trials", type=int, default=None, help="synthetic clean runs (default 20)")
    p.add_argument("--synth-clean-steps", type=int, default=1000)
    p.add_argument("--launch-timeout", type=float, default=3600.0, help="bound of one torchrun launch (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    add_load_argument(p)
    args = p.parse_args(argv)
    q = args.quick
    defaults = {
        "workload": ["device"] if q else sorted(WORKLOADS),
        "trials": 1 if q else 10,
        "job_trials": 1 if q else 4,
        "fsdp_trials": 0 if q else 4,
        "onset_max": 45 if q else 70,
        "post_steps": 20 if q else 30,
        "ab_blocks": 1 if q else 10,
        "ab_steps": 60 if q else 260,
        "synth_trials": 2 if q else 50,
        "synth_clean_trials": 1 if q else 20,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if q:
        args.synth_steps, args.synth_clean_steps = min(args.synth_steps, 160), min(args.synth_clean_steps, 300)
    return args


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    started = pc()
    machine = machine_info()
    check_load_at_start(machine, allow=args.allow_loaded, quick=args.quick, name=MODULE)
    since = cpu_counters()  # the ranks load the machine themselves: the end is judged by others' CPU time
    logging.getLogger("lightning_resilience.straggler").setLevel(logging.CRITICAL)  # verdict logs by the thousand
    real = {w: real_ddp(args, w) for w in args.workload}
    print_flush("[straggler] synthetic cross-check ...")
    synth = synthetic(args, KINDS)
    head = real["device"] if "device" in real else next(iter(real.values()))
    targets = []
    for factor in REAL_FACTORS:
        for kind in KINDS:
            g = head["groups"][f"{kind}@{factor}"]
            targets.append(
                target(
                    f"{kind}-slow rank at {factor}x named within (worst trial)",
                    g["latency_max"] if g["recall"] == 1.0 else None,
                    "<=",
                    TARGET_LATENCY[factor],
                    "steps",
                    f"recall {g['recall']:.2f}, precision {f2(g['precision'])}, median {g['latency_median']}",
                )
            )
    c = head["clean"]
    targets.append(
        target(
            "false verdicts per 1,000 clean steps",
            c["false_per_1k_steps"],
            "<=",
            TARGET_FALSE_PER_1K,
            "per 1k steps",
            f"{c['false_verdicts']} in {c['steps']} clean steps; {c['pre_onset_false_verdicts']} in the "
            f"{c['pre_onset_steps']} steps before the onsets",
        )
    )
    o = head["overhead"]
    targets.append(
        target(
            "overhead: mean step period with / without the detector - 1",
            o["mean_fraction"],
            "<=",
            TARGET_OVERHEAD,
            "fraction",
            f"interleaved; inside the hooks {o['hooks_s_per_step_mean'] * 1e3:.2f} ms a step "
            f"({fmt_pct(o['hooks_fraction'])})",
        )
    )
    if o.get("own_mean_fraction") is not None:
        targets.append(
            target(
                "overhead, the detector's own share: mean step period with the detector / with the step path alone - 1",
                o["own_mean_fraction"],
                "<=",
                TARGET_OVERHEAD,
                "fraction",
                f"interleaved; the step path alone (ResiliencePolicy, one agreement a step) "
                f"{fmt_pct(o['path_mean_fraction'])} over none",
            )
        )
    finish_load(machine, since)
    return {
        "benchmark": "straggler_detection",
        "title": TITLE,
        "command": command_line(MODULE, argv),
        "date": now_iso(),
        "total_wall_s": pc() - started,
        "machine": machine,
        "config": {k: v for k, v in vars(args).items() if k != "out"}
        | {"detector": {k: v for k, v in asdict(StragglerConfig()).items() if k != "levels"}},
        "real": real,
        "synthetic": synth,
        "targets": targets,
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    result = run(args, argv)
    path = write_json(args.out, result)
    print_flush("")
    print_flush(render_markdown(result))
    print_flush(f"[straggler] total {result['total_wall_s']:.0f}s; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
