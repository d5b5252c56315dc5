"""Straggler detection: how fast, how precise, how often wrong, and what it costs per step.

Run from the repository root::

    python -m benchmarks.straggler_detection            # 100 trials per slowdown + 50,000 clean steps, minutes
    python -m benchmarks.straggler_detection --quick    # smoke mode, seconds

Detection quality comes from many simulated trials fed through the REAL detector (``StragglerDetector``: timer,
scores, change point, ladder) with a fake clock per rank and an in-process gather: every rank's timer measures its
own simulated step, every rank prepares its payload, and rank 0 consumes the gathered payloads (all ranks compute the
same decisions from the same payloads; tests/straggler prove it). Step times follow a noise model meant to look like
a real job: a common-mode lognormal jitter every rank shares (batch content, the collective), an independent
per-rank lognormal jitter, occasional per-rank spikes (GC, a page fault, a noisy neighbour) and occasional job-wide
spikes (a checkpoint, a slow storage read). In a slow trial one random rank becomes ``factor`` x slower from a
random onset step to the end of the trial. Per slowdown factor it reports

* latency: slow steps observed up to and including the step of the first verdict naming the slow rank;
* precision: first correct verdicts / (first correct verdicts + verdicts naming another rank or coming before the
  onset); recall: trials whose slow rank was named;
* false alarms per 1,000 clean steps, over trials without any slowdown.

The overhead is measured on a real small training step (a torch MLP, forward + backward + SGD, one thread): the time
spent inside the detector's calls (start, three sections, end of step with the gather and the decision over
``--world`` payloads) against the median step time without the detector, plus the same difference measured A/B in
interleaved blocks (noisy on a shared machine; context only), plus the cost of one real 2-rank gloo all-gather of a
payload (the exchange; paid once per ``gather_every_n_steps``).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from benchmarks._common import (
    command_line,
    fmt_pct,
    machine_info,
    md_table,
    now_iso,
    print_flush,
    summarize,
    target,
    write_json,
)
from lightning_resilience.straggler import StragglerDetector, Verdict
from lightning_resilience.straggler.config import StragglerConfig

MODULE = "benchmarks.straggler_detection"
DEFAULT_OUT = "benchmarks/results/straggler_detection.json"
TITLE = "Straggler detection: latency, precision, recall, false alarms, overhead"

FACTORS = (1.1, 1.2, 1.5, 2.0)
# the goals of docs/benchmarks.md (see /work/shared/reference/papers.md, goals G6 and G7), at a 1.2x slowdown
TARGET_FACTOR = 1.2
TARGET_LATENCY_STEPS = 5
TARGET_PRECISION = 0.99
TARGET_RECALL = 0.97
TARGET_FALSE_ALARMS_PER_1K = 0.0
TARGET_OVERHEAD = 0.005

pc = time.perf_counter


@dataclass(frozen=True)
class NoiseModel:
    """Step-time model of the simulated ranks (fake seconds)."""

    base_s: float = 1.0
    common_sigma: float = 0.05
    """Lognormal sigma of the jitter every rank shares at a step."""
    rank_sigma: float = 0.03
    """Lognormal sigma of each rank's own jitter."""
    rank_spike_p: float = 0.005
    """Probability that a rank has a spike at a step."""
    job_spike_p: float = 0.01
    """Probability that every rank has a spike at a step."""
    spike_low: float = 1.5
    spike_high: float = 3.0


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------------------------- simulation
def run_trial(
    rng: np.random.Generator,
    cfg: StragglerConfig,
    noise: NoiseModel,
    world: int,
    steps: int,
    slow_rank: int | None,
    factor: float,
    onset: int,
) -> list[Verdict]:
    """One simulated job through real detectors; returns rank 0's verdicts."""
    clocks = [_Clock() for _ in range(world)]
    detectors = [
        StragglerDetector(
            cfg, rank=r, world_size=world, gather=lambda p: [p], clock=clocks[r], hostname=f"node{r // 8}"
        )
        for r in range(world)
    ]
    # draws for the whole trial at once (fast), applied step by step
    common = noise.base_s * np.exp(rng.normal(0.0, noise.common_sigma, steps))
    job_spike = rng.random(steps) < noise.job_spike_p
    common[job_spike] *= rng.uniform(noise.spike_low, noise.spike_high, int(job_spike.sum()))
    own = np.exp(rng.normal(0.0, noise.rank_sigma, (steps, world)))
    spike = rng.random((steps, world)) < noise.rank_spike_p
    own[spike] *= rng.uniform(noise.spike_low, noise.spike_high, int(spike.sum()))
    cost = common[:, None] * own
    if slow_rank is not None:
        cost[onset:, slow_rank] *= factor
    for step in range(steps):
        payloads = []
        for r in range(world):
            det, clock = detectors[r], clocks[r]
            clock.now += 0.002  # data wait
            det.start_step()
            clock.now += float(cost[step, r])
            det.timer.end_step()
            payloads.append(det.prepare(step))
        if payloads[0] is not None:
            detectors[0].consume(step, payloads)
    return detectors[0].verdicts


def detection_quality(args: argparse.Namespace, cfg: StragglerConfig, noise: NoiseModel) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    per_factor: dict[str, Any] = {}
    first_onset = cfg.warmup_steps + 2 * cfg.window // 4 + 16  # past the warm-up and the detector's own history
    for factor in FACTORS:
        latencies: list[int] = []
        tp = fp = missed = 0
        examples: list[dict[str, Any]] = []
        t0 = pc()
        for _ in range(args.trials):
            slow = int(rng.integers(args.world))
            onset = int(rng.integers(first_onset, args.trial_steps - 60))
            verdicts = run_trial(rng, cfg, noise, args.world, args.trial_steps, slow, factor, onset)
            good = [v for v in verdicts if v.rank == slow and v.step >= onset]
            bad = [v for v in verdicts if not (v.rank == slow and v.step >= onset)]
            fp += len(bad)
            examples += [{"slow_rank": slow, "onset": onset, **v.to_dict()} for v in bad]
            if good:
                tp += 1
                latencies.append(good[0].step - onset + 1)
            else:
                missed += 1
        ordered = sorted(latencies)
        per_factor[f"{factor}"] = {
            "factor": factor,
            "trials": args.trials,
            "detected": tp,
            "missed": missed,
            "false_verdicts": fp,
            "false_verdict_examples": examples[:10],
            "precision": tp / (tp + fp) if tp + fp else None,
            "recall": tp / args.trials,
            "recall_within_5_steps": sum(1 for x in latencies if x <= 5) / args.trials,
            "latency_steps_median": statistics.median(latencies) if latencies else None,
            "latency_steps_p90": ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)] if ordered else None,
            "latency_steps_max": ordered[-1] if ordered else None,
            "latency_steps": latencies,
            "wall_s": pc() - t0,
        }
        d = per_factor[f"{factor}"]
        print_flush(
            f"[straggler] {factor}x: recall {d['recall']:.3f} precision {_f3(d['precision'])} latency median "
            f"{d['latency_steps_median']} max {d['latency_steps_max']} ({d['wall_s']:.0f}s)"
        )
    clean_alarms: list[dict[str, Any]] = []
    t0 = pc()
    for _ in range(args.clean_trials):
        verdicts = run_trial(rng, cfg, noise, args.world, args.clean_steps, None, 1.0, 0)
        clean_alarms += [v.to_dict() for v in verdicts]
    clean_total = args.clean_trials * args.clean_steps
    clean = {
        "trials": args.clean_trials,
        "steps": clean_total,
        "rank_steps": clean_total * args.world,
        "false_alarms": len(clean_alarms),
        "false_alarms_per_1k_steps": len(clean_alarms) / clean_total * 1000 if clean_total else None,
        "alarms": clean_alarms[:20],
        "wall_s": pc() - t0,
    }
    print_flush(f"[straggler] clean: {clean['false_alarms']} false alarm(s) in {clean_total} steps")
    return {"factors": per_factor, "clean": clean}


# ------------------------------------------------------------------------------------------------------ overhead
class _Mlp:
    def __init__(self, width: int, depth: int, batch: int, seed: int) -> None:
        torch.manual_seed(seed)
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(batch, width)
        self.y = torch.randn(batch, 1)

    def forward(self) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.model(self.x), self.y)

    def step(self, det: StragglerDetector | None, step: int) -> float:
        """One training step; returns the seconds spent inside the detector's calls."""
        inside = 0.0
        if det is not None:
            t = pc()
            det.start_step()
            det.begin("forward")
            inside += pc() - t
        loss = self.forward()
        if det is not None:
            t = pc()
            det.end("forward")
            det.begin("backward")
            inside += pc() - t
        loss.backward()
        if det is not None:
            t = pc()
            det.end("backward")
            det.begin("optimizer")
            inside += pc() - t
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if det is not None:
            t = pc()
            det.end_step(step)
            inside += pc() - t
        return inside


class _SyntheticGather:
    """In-process gather: this rank's payload plus ``world - 1`` peers with the same times and their own jitter. Its
    own run time is accounted apart (``spent``): it stands in for the real all-gather, which is measured apart."""

    def __init__(self, world: int, seed: int) -> None:
        self.world = world
        self.rng = np.random.default_rng(seed)
        self.spent = 0.0

    def __call__(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        t0 = pc()
        out = [payload]
        jitter = np.exp(self.rng.normal(0.0, 0.03, self.world)).tolist()
        for r in range(1, self.world):
            out.append({**payload, "rank": r, "times": {k: v * jitter[r] for k, v in payload["times"].items()}})
        self.spent += pc() - t0
        return out


def overhead(args: argparse.Namespace, cfg: StragglerConfig) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    mlp = _Mlp(args.width, args.depth, args.batch, args.seed)
    gather = _SyntheticGather(args.world, args.seed)
    det = StragglerDetector(cfg, rank=0, world_size=args.world, gather=gather)
    for i in range(args.warmup):
        mlp.step(None, i)
        mlp.step(det, i)
    plain: list[float] = []
    with_det: list[float] = []
    inside: list[float] = []
    step = args.warmup
    for block in range(args.blocks):
        order = (None, det) if block % 2 == 0 else (det, None)
        for who in order:
            for _ in range(args.block):
                gather.spent = 0.0
                t0 = pc()
                spent = mlp.step(who, step) - gather.spent
                dt = pc() - t0
                step += 1
                if who is None:
                    plain.append(dt)
                else:
                    with_det.append(dt)
                    inside.append(spent)
    base = statistics.median(plain)
    mean_inside = statistics.fmean(inside)
    median_inside = statistics.median(inside)
    return {
        "model": {"width": args.width, "depth": args.depth, "batch": args.batch, "threads": args.threads},
        "world_simulated": args.world,
        "sections_tested": list(cfg.sections),
        "gather_every_n_steps": cfg.gather_every_n_steps,
        "step_plain": summarize(plain),
        "step_with_detector": summarize(with_det),
        "detector_calls": summarize(inside),
        "detector_median_s": median_inside,
        "detector_mean_s": mean_inside,
        "detector_p99_s": float(np.percentile(inside, 99)),
        "overhead_fraction": median_inside / base,
        "overhead_fraction_mean": mean_inside / base,
        "overhead_fraction_p99": float(np.percentile(inside, 99)) / base,
        "ab_fraction": statistics.median(with_det) / base - 1.0,
    }


def _gloo_child(rank: int, store_dir: str, reps: int, out_dir: str) -> None:
    import torch.distributed as dist

    from lightning_resilience.straggler import gloo_gather

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=2)
    try:
        gather = gloo_gather(dist.new_group(backend="gloo"))
        payload = {"rank": rank, "host": "h", "local_world_size": 1, "times": {"step": 0.1, "forward": 0.03}}
        samples = []
        for i in range(reps + 10):
            t0 = pc()
            gather(payload)
            if i >= 10:
                samples.append(pc() - t0)
        if rank == 0:
            with open(os.path.join(out_dir, "gloo.txt"), "w") as f:
                f.write("\n".join(str(s) for s in samples))
    finally:
        dist.destroy_process_group()


def gloo_gather_cost(reps: int) -> dict[str, Any]:
    """Median cost of one real all_gather_object of a payload between two local gloo ranks."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(_gloo_child, args=(tmp, reps, tmp), nprocs=2, join=True, start_method="spawn")
            with open(os.path.join(tmp, "gloo.txt")) as f:
                samples = [float(x) for x in f.read().split()]
        except Exception as err:  # the figure is context; the run should still report the rest
            return {"error": repr(err)}
    return summarize(samples)


# ------------------------------------------------------------------------------------------------------ driver
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke mode (seconds): few trials, short runs")
    p.add_argument("--world", type=int, default=8, help="simulated ranks")
    p.add_argument("--trials", type=int, default=None, help="slow trials per factor (default 100; quick 4)")
    p.add_argument("--trial-steps", type=int, default=None, help="steps per slow trial (default 300; quick 150)")
    p.add_argument("--clean-trials", type=int, default=None, help="clean trials (default 50; quick 1)")
    p.add_argument("--clean-steps", type=int, default=1000, help="steps per clean trial")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=1024, help="MLP width (overhead)")
    p.add_argument("--depth", type=int, default=4, help="MLP hidden layers (overhead)")
    p.add_argument("--batch", type=int, default=256, help="MLP batch (overhead)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the MLP step")
    p.add_argument("--blocks", type=int, default=None, help="A/B blocks (default 20; quick 2)")
    p.add_argument("--block", type=int, default=None, help="steps per A/B block (default 25; quick 10)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps of the MLP (default 20; quick 5)")
    p.add_argument("--gloo-reps", type=int, default=None, help="2-rank gloo all-gathers timed (default 200; quick 0)")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    args = p.parse_args(argv)
    q = args.quick
    defaults = {
        "trials": 4 if q else 100,
        "trial_steps": 150 if q else 300,
        "clean_trials": 1 if q else 50,
        "blocks": 2 if q else 20,
        "block": 10 if q else 25,
        "warmup": 5 if q else 20,
        "gloo_reps": 0 if q else 200,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    started = pc()
    machine = machine_info()
    logging.getLogger("lightning_resilience.straggler").setLevel(logging.CRITICAL)  # verdict logs by the thousand
    cfg = StragglerConfig()
    noise = NoiseModel()
    print_flush(f"[straggler] detection: {args.trials} trials x {len(FACTORS)} factors, {args.world} ranks ...")
    quality = detection_quality(args, cfg, noise)
    print_flush("[straggler] overhead on a real MLP step ...")
    over = overhead(args, cfg)
    gloo = gloo_gather_cost(args.gloo_reps) if args.gloo_reps > 0 else None
    if gloo and "median_s" in gloo:
        over["gloo_gather_median_s"] = gloo["median_s"]
        over["overhead_fraction_with_gloo_gather"] = (
            (over["detector_median_s"] + gloo["median_s"]) / over["step_plain"]["median_s"]
            if cfg.gather_every_n_steps == 1
            else None
        )
    at = quality["factors"][f"{TARGET_FACTOR}"]
    clean = quality["clean"]
    targets = [
        target(
            f"latency at {TARGET_FACTOR}x (worst trial)",
            at["latency_steps_max"],
            "<=",
            TARGET_LATENCY_STEPS,
            "steps",
            "slow steps seen up to the verdict, inclusive; median "
            f"{at['latency_steps_median']}, p90 {at['latency_steps_p90']}",
        ),
        target(f"precision at {TARGET_FACTOR}x", at["precision"], ">=", TARGET_PRECISION, "fraction", ""),
        target(f"recall at {TARGET_FACTOR}x", at["recall"], ">=", TARGET_RECALL, "fraction", f"{at['trials']} trials"),
        target(
            "false alarms per 1,000 clean steps",
            clean["false_alarms_per_1k_steps"],
            "<=",
            TARGET_FALSE_ALARMS_PER_1K,
            "per 1k steps",
            f"{clean['false_alarms']} in {clean['steps']} clean steps of {args.world} ranks",
        ),
        target(
            "detector overhead / step time",
            over["overhead_fraction"],
            "<=",
            TARGET_OVERHEAD,
            "fraction",
            f"median time inside the detector's calls / median MLP step "
            f"({over['step_plain']['median_s'] * 1e3:.1f} ms); mean {fmt_pct(over['overhead_fraction_mean'])}, p99 "
            f"{fmt_pct(over['overhead_fraction_p99'])} (preemptions on a shared machine); the all-gather is apart",
        ),
    ]
    machine["loadavg_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {
        "benchmark": "straggler_detection",
        "title": TITLE,
        "command": command_line(MODULE, argv),
        "date": now_iso(),
        "total_wall_s": pc() - started,
        "machine": machine,
        "config": {
            "quick": args.quick,
            "world": args.world,
            "trials_per_factor": args.trials,
            "trial_steps": args.trial_steps,
            "clean_trials": args.clean_trials,
            "clean_steps": args.clean_steps,
            "seed": args.seed,
            "factors": list(FACTORS),
            "noise": asdict(noise),
            "detector": {k: v for k, v in asdict(cfg).items() if k not in ("levels",)},
        },
        "detection": quality,
        "overhead": over,
        "gloo_gather": gloo,
        "targets": targets,
    }


def _val(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _val(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _f3(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def render_markdown(r: dict[str, Any], *, heading: str = "##") -> str:
    """Markdown tables of one result (also printed to stdout at the end of a run)."""
    cfg, m, det, over = r["config"], r["machine"], r["detection"], r["overhead"]
    noise = cfg["noise"]
    out = [f"{heading} {r['title']}", ""]
    out.append(
        f"*Command:* `{r['command']}` · *Date:* {r['date']} · *Run time:* {r['total_wall_s'] / 60:.1f} min · "
        f"{m['cpu_count']} cores ({m['cpu_model']}), torch {m['torch']}."
    )
    out += [
        "",
        f"Simulated jobs of {cfg['world']} ranks through the real `StragglerDetector` (fake clocks, in-process "
        f"gather, default `StragglerConfig`). Noise: common lognormal sigma {noise['common_sigma']}, per-rank "
        f"lognormal sigma {noise['rank_sigma']}, per-rank spikes p={noise['rank_spike_p']} and job-wide spikes "
        f"p={noise['job_spike_p']} of {noise['spike_low']}-{noise['spike_high']}x. {cfg['trials_per_factor']} trials "
        f"of {cfg['trial_steps']} steps per slowdown (random rank, random onset); latency = slow steps seen up to "
        "the verdict, inclusive.",
        "",
    ]
    rows = []
    for d in det["factors"].values():
        rows.append(
            [
                f"{d['factor']}x",
                f"{d['recall']:.3f}",
                _f3(d["precision"]),
                d["latency_steps_median"],
                d["latency_steps_p90"],
                d["latency_steps_max"],
                f"{d['recall_within_5_steps']:.3f}",
                d["false_verdicts"],
            ]
        )
    out.append(
        md_table(
            ["slowdown", "recall", "precision", "latency median", "p90", "max", "recall within 5 steps", "false"],
            rows,
        )
    )
    c = det["clean"]
    out += [
        "",
        f"Clean runs: **{c['false_alarms']}** false alarm(s) in {c['steps']} steps "
        f"({c['rank_steps']} rank-steps), i.e. {c['false_alarms_per_1k_steps']:.3f} per 1,000 steps.",
        "",
        f"Overhead on a real MLP step (width {over['model']['width']}, depth {over['model']['depth']}, batch "
        f"{over['model']['batch']}, {over['model']['threads']} thread; median "
        f"{over['step_plain']['median_s'] * 1e3:.1f} ms): the detector's calls take a median "
        f"{over['detector_median_s'] * 1e6:.0f} us per step (mean {over['detector_mean_s'] * 1e6:.0f} us, p99 "
        f"{over['detector_p99_s'] * 1e6:.0f} us) with {over['world_simulated']} ranks' payloads = "
        f"**{fmt_pct(over['overhead_fraction'])}** of the step (mean {fmt_pct(over['overhead_fraction_mean'])}); "
        f"A/B interleaved median difference {fmt_pct(over['ab_fraction'])} (noise on a shared machine).",
    ]
    gloo = r.get("gloo_gather")
    if gloo and gloo.get("median_s") is not None:
        out.append(
            f"One real 2-rank gloo all-gather of a payload: median {gloo['median_s'] * 1e6:.0f} us "
            f"(p90 {gloo['p90_s'] * 1e6:.0f} us), paid once every `gather_every_n_steps` steps"
            + (
                f": detector + one such all-gather every step = {fmt_pct(over['overhead_fraction_with_gloo_gather'])}"
                " of the step."
                if over.get("overhead_fraction_with_gloo_gather") is not None
                else "."
            )
        )
    trows = [
        [t["name"], _val(t["value"]), f"{t['op']} {t['threshold']} {t['unit']}", t["verdict"], t["note"]]
        for t in r["targets"]
    ]
    out += ["", md_table(["target", "measured", "goal", "verdict", "how"], trows), ""]
    return "\n".join(out)


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
