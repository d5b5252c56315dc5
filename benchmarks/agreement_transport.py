"""What the step agreement costs the step, by transport: direct TCP links (the suite's) against gloo point-to-point.

Usage (from the repository root)::

    python -m benchmarks.agreement_transport            # the published run (a few minutes on 2 quiet cores)
    python -m benchmarks.agreement_transport --quick    # smoke mode, nothing to publish

Two CPU ranks (gloo, one thread each) train an MLP under DDP (about 35 ms a step here). Three arms take turns in
blocks of ``--block`` steps, the order rotated every block, in one run: ``none`` (the bare step), ``gloo`` (the
suite's :class:`~lightning_resilience.step.driver.StepDriver` with its one round a step over a
:class:`~lightning_resilience.step.agreement.TreeAgreement` on a gloo side group) and ``tcp`` (the same over the
direct TCP links the suite uses, ``SideGroup(transport="tcp")``). The round is issued at the step's start and taken
at its end, as in a Lightning job. Slowdown of each arm over ``none``: mean, median and p99 step time, and the mean
of the per-block slowdowns with its 95% interval. Per transport, the CPU of the agreement's thread per step, at one
round a step between steps that compute (its thread's own CPU clock); and a round alone (issued and taken at once,
no step): its latency and the process CPU it costs each rank. CPU only.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from benchmarks import _common as bench

MODULE = "benchmarks.agreement_transport"
TITLE = "The step agreement's cost to the step, by transport: direct TCP links against gloo point-to-point"
DEFAULT_OUT = str(bench.RESULTS_DIR / "agreement_transport.json")
README_PENDING = f"**{TITLE}**: no result yet (`python -m {MODULE}` on a quiet machine)."
ARMS = ("none", "gloo", "tcp")
TRANSPORTS = ("gloo", "tcp")
GOAL = 0.005
"""The step path's one agreement a step against the bare step: at most +0.5% mean (the detectors' goal)."""


class _Actor:
    """Decisions of the driver: none come in this benchmark (no verdict is posted)."""

    def rollback(self, decision: Any) -> Any:
        return decision

    def stop(self, decision: Any) -> None: ...

    def note(self, decision: Any) -> None: ...


def _rank(rank: int, blocks: int, block: int, warmup: int, rounds: int, width: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from lightning_resilience.collective import SideGroup
    from lightning_resilience.policy import PolicyConfig
    from lightning_resilience.step.agreement import Op, TreeAgreement
    from lightning_resilience.step.driver import StepDriver

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(6)])
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(256, width)
    groups = {t: SideGroup(f"bench-{t}", timedelta(seconds=120), transport=t) for t in TRANSPORTS}
    drivers = {t: StepDriver(PolicyConfig(), TreeAgreement(g)) for t, g in groups.items()}
    actor = _Actor()

    def step(i: int, arm: str) -> float:
        driver = drivers.get(arm)
        t0 = time.perf_counter()
        if driver is not None:
            driver.begin_step(i)
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if driver is not None:
            driver.end_step(i + 1, actor)
        return time.perf_counter() - t0

    i = 0
    for arm in ARMS:
        for _ in range(warmup):
            step(i, arm)
            i += 1
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    per_block: dict[str, list[float]] = {a: [] for a in ARMS}
    thread_cpu: dict[str, float] = {t: 0.0 for t in TRANSPORTS}  # the agreement thread's, summed over the blocks
    for b in range(blocks):
        for arm in ARMS[b % len(ARMS) :] + ARMS[: b % len(ARMS)]:
            got = []
            tree = drivers[arm].agreement if arm in drivers else None
            before = tree.thread_cpu_seconds() if tree is not None else None
            for _ in range(block):
                got.append(step(i, arm))
                i += 1
            after = tree.thread_cpu_seconds() if tree is not None else None
            if before is not None and after is not None:
                thread_cpu[arm] += after - before
            times[arm] += got
            per_block[arm].append(statistics.fmean(got))
    alone: dict[str, dict[str, float]] = {}
    for t in TRANSPORTS:
        tree = drivers[t].agreement
        torch.distributed.barrier()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for r in range(rounds):
            tree.reduce([rank] * 8, [Op.MAX] * 8, op="bench.round", step=r).result()
        alone[t] = {
            "cpu_us": 1e6 * (time.process_time() - cpu0) / rounds,
            "latency_us": 1e6 * (time.perf_counter() - wall0) / rounds,
        }
    for t in TRANSPORTS:
        drivers[t].agreement.close()
        groups[t].close()
    thread_us = {t: 1e6 * v / len(times[t]) for t, v in thread_cpu.items()}
    return {
        "times": times,
        "per_block": per_block,
        "alone": alone,
        "thread_us": thread_us,
        "cpu_s": time.process_time(),
    }


def _arm(samples: list[float], blocks: list[float], base: list[float], base_blocks: list[float]) -> dict[str, Any]:
    per_block = [a / b - 1.0 for a, b in zip(blocks, base_blocks)]
    interval = bench.mean_interval(per_block)
    return {
        "mean_s": statistics.fmean(samples),
        "median_s": statistics.median(samples),
        "p99_s": bench.percentile(samples, 99),
        **bench.slowdowns(samples, base),
        "per_block_slowdown": per_block,
        "per_block_interval95": None if interval is None else list(interval[1:]),
    }


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from tests.sdc._spawn import run_ranks

    machine = bench.machine_info()
    bench.check_load_at_start(machine, allow=args.allow_loaded, quick=args.quick, name=MODULE)
    since, started = bench.cpu_counters(), time.perf_counter()
    blocks, block = (3, 5) if args.quick else (args.blocks, args.block)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_ranks(
            _rank,
            2,
            Path(tmp),
            blocks,
            block,
            3 if args.quick else 20,
            50 if args.quick else args.rounds,
            args.width,
            timeout_s=3600.0,
        )
    own_extra = sum(r["cpu_s"] for r in ranks)
    times, per_block = ranks[0]["times"], ranks[0]["per_block"]
    arms = {a: _arm(times[a], per_block[a], times["none"], per_block["none"]) for a in ARMS if a != "none"}
    tcp, gloo = arms["tcp"], arms["gloo"]
    result = {
        "benchmark": "agreement_transport",
        "title": TITLE,
        "command": bench.command_line(MODULE, argv),
        "date": bench.now_iso(),
        "total_wall_s": time.perf_counter() - started,
        "machine": bench.finish_load(machine, since, own_extra_s=own_extra),
        "quick": args.quick,
        "config": {"world": 2, "blocks": blocks, "block_steps": block, "width": args.width, "rounds": args.rounds},
        "none": {
            "mean_s": statistics.fmean(times["none"]),
            "median_s": statistics.median(times["none"]),
            "p99_s": bench.percentile(times["none"], 99),
        },
        "arms": arms,
        "round_alone": {t: [r["alone"][t] for r in ranks] for t in TRANSPORTS},
        "thread_cpu_us_per_step": {t: [r["thread_us"][t] for r in ranks] for t in TRANSPORTS},
        "targets": [
            bench.target(
                "step path over the TCP links: step-time slowdown, mean", tcp["slowdown_mean"], "<=", GOAL, ""
            ),
            bench.target(
                "step path over the TCP links: step-time slowdown, median",
                tcp["slowdown_median"],
                "<=",
                GOAL,
                "",
            ),
            bench.target(
                "gloo point-to-point (the earlier transport): step-time slowdown, mean",
                gloo["slowdown_mean"],
                "<=",
                GOAL,
                "",
                note="for comparison",
            ),
        ],
    }
    return result


def render_markdown(result: dict[str, Any]) -> str:
    none = result["none"]
    rows = [
        [
            "none",
            bench.fmt_ms(none["mean_s"]),
            bench.fmt_ms(none["median_s"]),
            bench.fmt_ms(none["p99_s"]),
            "",
            "",
            "",
            "",
        ]
    ]
    for name, arm in result["arms"].items():
        lo_hi = arm["per_block_interval95"]
        rows.append(
            [
                f"driver + one round a step, {name}",
                bench.fmt_ms(arm["mean_s"]),
                bench.fmt_ms(arm["median_s"]),
                bench.fmt_ms(arm["p99_s"]),
                bench.fmt_pct(arm["slowdown_mean"]),
                bench.fmt_pct(arm["slowdown_median"]),
                bench.fmt_pct(arm["slowdown_p99"]),
                "n/a" if lo_hi is None else f"{lo_hi[0] * 100:+.2f}% to {lo_hi[1] * 100:+.2f}%",
            ]
        )
    alone = [
        [t, ", ".join(f"{r['cpu_us']:.0f}" for r in per), ", ".join(f"{r['latency_us']:.0f}" for r in per)]
        for t, per in result["round_alone"].items()
    ]
    per_step = result.get("thread_cpu_us_per_step") or {}
    thread_rows = [[t, ", ".join(f"{v:.0f}" for v in per)] for t, per in per_step.items()]
    cfg = result["config"]
    return "\n".join(
        [
            f"## {result['title']}",
            "",
            f"`{result['command']}` — {result['date']}, 2 CPU ranks (gloo training group, DDP MLP of 6 x "
            f"{cfg['width']}), "
            f"{cfg['blocks']} blocks of {cfg['block_steps']} steps per arm, interleaved with the order rotated; "
            f"{bench.load_line(result['machine'])}. CPU only.",
            "",
            bench.md_table(
                ["arm", "mean", "median", "p99", "slowdown mean", "median", "p99", "per-block mean, 95%"], rows
            ),
            "",
            "The agreement thread's CPU per step, one round a step between steps that compute, per rank "
            "(rank 0, rank 1):",
            "",
            bench.md_table(["transport", "agreement thread CPU per step (us)"], thread_rows),
            "",
            "A round alone (issued and taken at once, no step), per rank (rank 0, rank 1):",
            "",
            bench.md_table(["transport", "process CPU per round (us)", "latency per round (us)"], alone),
            "",
            bench.targets_table(result["targets"], digits=4),
            "",
            "Why the links: gloo's point-to-point costs more than its CPU per round suggests, because its transport "
            "thread and its Python-level work per message take the interpreter while the step computes "
            '(docs/design.md, "What a round costs").',
        ]
    )


def readme_summary(result: dict[str, Any]) -> str:
    tcp, gloo = result["arms"]["tcp"], result["arms"]["gloo"]
    return (
        f"**The step agreement** (2 DDP ranks, CPU, one round a step issued at its start and taken at its end): "
        f"{bench.fmt_pct(tcp['slowdown_mean'])} mean step time over the direct TCP links the suite uses "
        f"(median {bench.fmt_pct(tcp['slowdown_median'])}, goal ≤ 0.5%: "
        f"{result['targets'][0]['verdict']}), against {bench.fmt_pct(gloo['slowdown_mean'])} through gloo's "
        "point-to-point."
    )


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=12, help="blocks per arm (interleaved, order rotated)")
    p.add_argument("--block", type=int, default=40, help="steps per block")
    p.add_argument("--rounds", type=int, default=2000, help="rounds alone per transport")
    p.add_argument("--width", type=int, default=512, help="width of the MLP's layers")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true", help="smoke mode: a few short blocks, nothing to publish")
    bench.add_load_argument(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return bench.run_and_publish(argv, parse, run, render_markdown, DEFAULT_OUT)


if __name__ == "__main__":
    raise SystemExit(main())
