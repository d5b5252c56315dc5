"""The straggler detector's own share of the step time, paired inside each run: on and off in neighbouring spans.

Usage (from the repository root)::

    python -m benchmarks.straggler_overhead            # the published run (about 10 minutes on 2 quiet cores)
    python -m benchmarks.straggler_overhead --quick    # smoke mode, nothing to publish

``benchmarks.straggler_detection`` measures the detector's overhead between launches: each arm (with the detector,
the suite's step path alone, nothing) is a job of its own, and the blocks are interleaved. On this machine one
launch's mean step differs from the next one's by about 1.7% whatever it runs, so ten blocks pin a share of a few
tenths of a percent down to no better than +-1.1 points.

Here each trial is one Lightning ``fit`` on 2 DDP CPU ranks (torchrun, gloo; the same model, data and workloads as
``benchmarks.straggler_detection``) with the default ``StragglerDetection()`` and the suite's step path. The
detector is on for ``--span`` steps, then off for as many (none of its hooks nor its step end runs: the step path
alone), and so on; every other trial starts off. Each pair of neighbouring spans gives one ratio (mean step period
on / off - 1): the machine's drift, slower than two spans, cancels out of it. The detector's exchange of timings
(every ``gather_every_n_steps``, on the agreement's thread) and rank 0's scoring happen in the spans on, so they
are counted. Off, the wait probes' forward pre-hooks stay registered and return at once: a few microseconds a
step counted on both sides. CPU only (the ``device`` workload waits 60 ms in each forward as a host waits for an
accelerator; ``cpu`` computes a wider MLP on the core).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _common as bench
from benchmarks.straggler_detection import WARM_STEPS, WORKLOADS, launch_drills

MODULE = "benchmarks.straggler_overhead"
TITLE = "The straggler detector's own share of the step time, paired: on and off in neighbouring spans of one run"
DEFAULT_OUT = str(bench.RESULTS_DIR / "straggler_overhead.json")
README_PENDING = f"**{TITLE}**: no result yet (`python -m {MODULE}` on a quiet machine)."
GOAL = 0.005
"""The detector's own share of the mean step time: at most +0.5%."""


def _pairs(trial: list[dict[str, Any]], span: int) -> tuple[list[float], list[float], list[float]]:
    """Per pair of neighbouring spans, on / off - 1; and the step periods on and off (mean over the ranks, per step,
    after the warm-up)."""
    on = trial[0]["on"]
    n = min(len(r["periods_s"]) for r in trial)
    periods = [statistics.fmean(r["periods_s"][i] for r in trial) for i in range(n)]
    spans: list[tuple[bool, list[float]]] = []
    for start in range(0, n - span + 1, span):
        if start < WARM_STEPS:
            continue
        spans.append((on[start], periods[start : start + span]))
    ratios: list[float] = []
    for (a_on, a), (_, b) in zip(spans[0::2], spans[1::2]):  # spans alternate on and off
        with_, without = (a, b) if a_on else (b, a)
        ratios.append(statistics.fmean(with_) / statistics.fmean(without) - 1.0)
    on_p = [p for is_on, ps in spans for p in ps if is_on]
    off_p = [p for is_on, ps in spans for p in ps if not is_on]
    return ratios, on_p, off_p


def _workload(args: argparse.Namespace, workload: str) -> dict[str, Any]:
    trials = [f"toggle:{i % 2}:1.0:{args.span}:{args.steps}" for i in range(args.trials)]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results = launch_drills(trials, workload, args, Path(tmp))
    ratios: list[float] = []
    on_p: list[float] = []
    off_p: list[float] = []
    hooks: list[float] = []
    hooks_cpu: list[float] = []
    driver: list[float] = []
    scoring: list[float] = []
    verdicts: list[dict[str, Any]] = []
    for i, trial in enumerate(results):
        r, a, b = _pairs(trial, args.span)
        ratios += r
        on_p += a
        off_p += b
        for rank in trial:
            n_on = max(1, sum(rank["on"]))
            steps = rank["trial"]["steps"]
            hooks.append(rank["detector_s_per_step"] * steps / n_on)
            hooks_cpu.append(rank["detector_cpu_s_per_step"] * steps / n_on)
            driver.append(rank["driver_s_per_step"])  # every step, on and off
            if rank["rank"] == 0:  # its scoring process (its only child) scores the exchanges of the spans on
                scoring.append(rank["children_cpu_s"] / n_on)
            verdicts += [{**v, "trial": i, "seen_on_rank": rank["rank"]} for v in rank["verdicts"]]
    interval = bench.mean_interval(ratios)
    median_off = statistics.median(off_p)
    return {
        "workload": workload,
        "workload_args": WORKLOADS[workload],
        "pairs": len(ratios),
        "share_mean": interval[0] if interval else None,
        "share_interval95": list(interval[1:]) if interval else None,
        "per_pair": ratios,
        "pooled_mean_fraction": statistics.fmean(on_p) / statistics.fmean(off_p) - 1.0,
        "on": bench.summarize(on_p) | {"samples_s": []},
        "off": bench.summarize(off_p) | {"samples_s": []},
        **{f"pooled_{k}": v for k, v in bench.slowdowns(on_p, off_p).items()},
        "hooks_s_per_step_on": statistics.fmean(hooks),
        "hooks_fraction": statistics.fmean(hooks) / median_off,
        "hooks_cpu_s_per_step_on": statistics.fmean(hooks_cpu),
        "driver_s_per_step": statistics.fmean(driver),
        "scoring_cpu_s_per_step_on": statistics.fmean(scoring),
        "scoring_fraction": statistics.fmean(scoring) / median_off,
        "false_verdicts": len(verdicts),
        "verdicts": verdicts,
        "wall_s": time.perf_counter() - started,
    }


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    if args.quick:
        args.trials, args.steps, args.span = 2, 60, 10
    machine = bench.machine_info()
    bench.check_load_at_start(machine, allow=args.allow_loaded, quick=args.quick, name=MODULE)
    since, started = bench.cpu_counters(), time.perf_counter()
    workloads = {w: _workload(args, w) for w in args.workloads}
    targets = [
        bench.target(
            f"the detector's own share of the mean step time, paired ({w} workload)",
            res["share_mean"],
            "<=",
            GOAL,
            "",
            note=_interval_note(res),
        )
        for w, res in workloads.items()
    ]
    return {
        "benchmark": "straggler_overhead",
        "title": TITLE,
        "command": bench.command_line(MODULE, argv),
        "date": bench.now_iso(),
        "total_wall_s": time.perf_counter() - started,
        "machine": bench.finish_load(machine, since),
        "quick": args.quick,
        "config": {
            "world": args.world,
            "trials": args.trials,
            "steps": args.steps,
            "span": args.span,
            "warm_steps": WARM_STEPS,
            "workloads": list(args.workloads),
        },
        "workloads": workloads,
        "targets": targets,
    }


def _interval_note(res: dict[str, Any]) -> str:
    lo_hi = res["share_interval95"]
    if lo_hi is None:
        return ""
    return f"95% interval {lo_hi[0] * 100:+.2f}% to {lo_hi[1] * 100:+.2f}% over {res['pairs']} pairs of spans"


def _verdicts(res: dict[str, Any]) -> str:
    """Verdicts in these clean fits; job-wide ones (every rank slower than its own best) say the machine slowed."""
    job = sum(1 for v in res["verdicts"] if v.get("scope") == "job")
    return f"{res['false_verdicts']} (job-wide: {job})" if res["false_verdicts"] else "0"


def render_markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    rows = []
    for w, res in result["workloads"].items():
        lo_hi = res["share_interval95"]
        rows.append(
            [
                w,
                bench.fmt_ms(res["off"]["mean_s"]),
                bench.fmt_ms(res["on"]["mean_s"]),
                f"**{bench.fmt_pct(res['share_mean'])}**",
                "n/a" if lo_hi is None else f"{lo_hi[0] * 100:+.2f}% to {lo_hi[1] * 100:+.2f}%",
                str(res["pairs"]),
                bench.fmt_pct(res["pooled_slowdown_median"]),
                bench.fmt_pct(res["pooled_slowdown_p99"]),
                f"{res['hooks_s_per_step_on'] * 1e3:.3f} ms ({bench.fmt_pct(res['hooks_fraction'])})",
                f"{res['scoring_cpu_s_per_step_on'] * 1e3:.3f} ms ({bench.fmt_pct(res['scoring_fraction'])})",
                _verdicts(res),
            ]
        )
    header = ["workload", "step off (mean)", "step on (mean)", "own share (mean of pairs)", "95% interval",
              "pairs", "median", "p99", "in its hooks, a step on", "rank 0's scoring process, CPU a step on",
              "verdicts"]  # fmt: skip
    return "\n".join(
        [
            f"## {result['title']}",
            "",
            f"`{result['command']}` — {result['date']}, {cfg['world']} DDP CPU ranks (torchrun, gloo), "
            f"{cfg['trials']} fits of {cfg['steps']} steps per workload, the detector on and off in spans of "
            f"{cfg['span']} steps (the first {cfg['warm_steps']} steps left out); "
            f"{bench.load_line(result['machine'])}. CPU only.",
            "",
            bench.md_table(header, rows),
            "",
            bench.targets_table(result["targets"], digits=4),
            "",
            "Paired inside each run, so the drift between launches (about 1.7% of the mean step here) cancels out; "
            "`benchmarks.straggler_detection` measures the same share between launches, to about +-1.1 points. The "
            "median and p99 columns compare the pooled steps on against the pooled steps off. Off, the wait "
            "probes' forward pre-hooks stay registered and return at once (counted on both sides). Rank 0's scoring "
            "process: its CPU time over each fit (user and system, in 10 ms ticks; it scores only the spans on) per "
            "step on; where both ranks keep both cores busy (the cpu workload) that time is taken from a rank.",
        ]
    )


def readme_summary(result: dict[str, Any]) -> str:
    parts = []
    for w, res in result["workloads"].items():
        lo_hi = res["share_interval95"]
        where = "" if lo_hi is None else f" (95% interval {lo_hi[0] * 100:+.2f}% to {lo_hi[1] * 100:+.2f}%)"
        parts.append(f"{bench.fmt_pct(res['share_mean'])}{where} with the {w} workload")
    verdicts = ", ".join(t["verdict"] for t in result["targets"])
    return (
        "**The straggler detector's own share of the step time**, paired on and off in neighbouring spans of one "
        f"run (2 DDP CPU ranks, default config): {'; '.join(parts)}; goal ≤ 0.5%: {verdicts}."
    )


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", default=["device", "cpu"], choices=sorted(WORKLOADS))
    p.add_argument("--trials", type=int, default=16, help="fits per workload (one launch), every other starting off")
    p.add_argument("--steps", type=int, default=300, help="steps per fit")
    p.add_argument("--span", type=int, default=20, help="steps on, then as many off")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--launch-timeout", type=float, default=3600.0)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true", help="smoke mode: two short fits, nothing to publish")
    bench.add_load_argument(p)
    args = p.parse_args(argv)
    if args.span < 2 or args.steps < 4 * args.span + WARM_STEPS:
        p.error(f"--steps must hold at least two pairs of spans after the warm-up: {args.steps} < "
                f"4 x {args.span} + {WARM_STEPS}")  # fmt: skip
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return bench.run_and_publish(argv, parse, run, render_markdown, DEFAULT_OUT)


if __name__ == "__main__":
    raise SystemExit(main())
