"""What rank 0's training process pays for the straggler exchange at 1,024 to 16,384 ranks.

Usage (from the repository root)::

    python -m benchmarks.exchange_rank0                         # the published run (a few minutes on 2 quiet cores)
    python -m benchmarks.exchange_rank0 --baseline-tree DIR     # also the suite in DIR (a checkout of an earlier
                                                                # commit), interleaved with this one
    python -m benchmarks.exchange_rank0 --quick                 # smoke mode, nothing to publish

Every ``gather_every_n_steps`` steps each rank sends its timings up the step agreement's tree, and rank 0 receives
every rank's: megabytes at thousands of ranks. Which work that grows with N lands in rank 0's *training process*
(its agreement thread, its scorer's sender thread, its training thread) decides whether an exchange step is slower
on rank 0, and every rank waits for rank 0 at the next gradient all-reduce. Scoring itself runs in rank 0's scoring
process (its own interpreter), so it is not counted.

One process stands for rank 0 of N ranks: a real :class:`~lightning_resilience.straggler.StragglerDetector` on a real
:class:`~lightning_resilience.step.agreement.TreeAgreement`, with the default config and its scoring process (on a
core of its own, as on a node), whose side group delivers what rank 0's 4 children would send: each child's blob of
its subtree's records (real payloads of 10 steps of 7 sections, host names 8 ranks a node; each rank as healthy as
rank 0, its timings jittering 5% around rank 0's step, so that no verdict is reached), copied as a receive
copies it. The training thread computes pure-Python work in slices of about 0.1 ms and calls the detector's step
hooks; in blocks of 50 steps the detector is on, then off (the same work without it). Reported per N: what an
exchange adds to rank 0's training thread (its time in the detector's calls, plus the time its slices were held up
beyond twice their usual length, on less off: the interpreter lock held by another thread of the process, which
drift does not fake), the longest hold-up, the bytes that reach rank 0 and the bytes per rank. With
``--baseline-tree`` the same runs against an earlier source tree in the same run, the two taking turns. CPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _common as bench

MODULE = "benchmarks.exchange_rank0"
TITLE = "Rank 0's training process during the straggler exchange at 1k to 16k ranks"
DEFAULT_OUT = str(bench.RESULTS_DIR / "exchange_rank0.json")
README_PENDING = f"**{TITLE}**: no result yet (`python -m {MODULE}` on a quiet machine)."
RANKS = (16, 1024, 4096, 16384)
"""16 ranks is the reference: a few KB reach rank 0, so what an exchange adds there is what it costs whatever N."""
BLOCK = 50
CHILD = Path(__file__).with_name("_exchange_rank0_child.py")
GOAL_MS = 1.0
"""What an exchange may add to rank 0's training thread at 16,384 ranks (every 10 steps: 0.1 ms a step)."""


def _launch(tree: Path, ranks: int, steps: int, step_ms: float) -> dict[str, Any]:
    """Rank 0 of ``ranks`` in a process of its own, importing the suite from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(CHILD), str(ranks), str(steps), str(step_ms)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"rank 0 of {ranks} ({tree}) failed: {proc.stderr[-3000:]}")
    got = dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    if Path(got.pop("suite")).resolve().parent != (tree / "lightning_resilience").resolve():
        raise RuntimeError(f"rank 0 of {ranks} imported the suite from elsewhere than {tree}")
    return got


def _arm(runs: list[dict[str, Any]]) -> dict[str, Any]:
    added = [
        (r["hooks_s_per_step"] + r["stall_s_per_step_on"] - r["stall_s_per_step_off"]) * r["gather_every_n_steps"]
        for r in runs
    ]
    interval = bench.mean_interval(added)
    return {
        "added_per_exchange_s": statistics.fmean(added),
        "added_interval95_s": list(interval[1:]) if interval else None,
        "hooks_per_exchange_s": statistics.fmean(r["hooks_s_per_step"] * r["gather_every_n_steps"] for r in runs),
        "worst_hold_on_s": max(r["worst_hold_on_s"] for r in runs),
        "worst_hold_off_s": max(r["worst_hold_off_s"] for r in runs),
        "step_s": statistics.fmean(r["step_s"] for r in runs),
        "bytes_at_rank0": runs[0]["bytes_at_rank0"],
        "bytes_per_rank": runs[0]["bytes_per_rank"],
        "scoring_median_s": statistics.median(s for r in runs for s in r["scoring_s"]),
        "scoring_max_s": max(s for r in runs for s in r["scoring_s"]),
        "runs": runs,
    }


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    machine = bench.machine_info()
    bench.check_load_at_start(machine, allow=args.allow_loaded, quick=args.quick, name=MODULE)
    since, started = bench.cpu_counters(), time.perf_counter()
    ranks = (16, 1024) if args.quick else RANKS
    reps, steps = (1, 2 * BLOCK) if args.quick else (args.reps, args.blocks * 2 * BLOCK)
    trees = {"this tree": bench.REPO_ROOT} | ({"baseline": Path(args.baseline_tree)} if args.baseline_tree else {})
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {t: {n: [] for n in ranks} for t in trees}
    for rep in range(reps):
        for n in ranks:
            order = list(trees) if rep % 2 == 0 else list(reversed(trees))  # each goes first in turn
            for name in order:
                bench.print_flush(f"[exchange_rank0] rep {rep}, {n} ranks, {name}")
                runs[name][n].append(_launch(trees[name], n, steps, args.step_ms))
    arms = {name: {str(n): _arm(per) for n, per in by_n.items()} for name, by_n in runs.items()}
    at_most = arms["this tree"][str(ranks[-1])]
    steps_per_exchange = runs["this tree"][ranks[-1]][0]["gather_every_n_steps"]
    baseline_commit = _commit(Path(args.baseline_tree)) if args.baseline_tree else None
    return {
        **bench.result_header("exchange_rank0", TITLE, MODULE, argv, started, machine, since),
        "quick": args.quick,
        "config": {
            "reps": reps,
            "steps": steps,
            "block": BLOCK,
            "step_ms": args.step_ms,
            "ranks": list(ranks),
            "this_commit": _commit(bench.REPO_ROOT),
            "baseline_commit": baseline_commit,
        },
        "arms": arms,
        "targets": [
            bench.target(
                f"added to rank 0's training thread per exchange at {ranks[-1]} ranks",
                at_most["added_per_exchange_s"] * 1e3,
                "<=",
                GOAL_MS,
                "ms",
                note="its calls and the hold-ups of its work, on less off, per exchange period",
            ),
            bench.target(
                f"rank 0's scorer at {ranks[-1]} ranks: scoring an exchange (median) / the time between exchanges",
                at_most["scoring_median_s"] / (at_most["step_s"] * steps_per_exchange),
                "<=",
                1.0,
                "x",
                note=f"the scorer keeps up with an exchange every {steps_per_exchange} steps of "
                f"{at_most['step_s'] * 1e3:.0f} ms; longer steps give it longer",
            ),
        ],
    }


def _commit(tree: Path) -> str | None:
    proc = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def render_markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    rows = []
    for name, by_n in result["arms"].items():
        commit = cfg["this_commit"] if name == "this tree" else cfg["baseline_commit"]
        for n, arm in by_n.items():
            lo_hi = arm["added_interval95_s"]
            rows.append(
                [
                    f"{name} ({commit})" if commit else name,
                    n,
                    f"{arm['bytes_per_rank']:.0f}",
                    f"{arm['bytes_at_rank0'] / 1e6:.1f}",
                    f"**{arm['added_per_exchange_s'] * 1e3:.1f}**",
                    "n/a" if lo_hi is None else f"{lo_hi[0] * 1e3:.1f} to {lo_hi[1] * 1e3:.1f}",
                    f"{arm['hooks_per_exchange_s'] * 1e3:.1f}",
                    f"{arm['worst_hold_on_s'] * 1e3:.1f} / {arm['worst_hold_off_s'] * 1e3:.1f}",
                    bench.fmt_ms(arm["step_s"]),
                    f"{arm['scoring_median_s'] * 1e3:.0f} / {arm['scoring_max_s'] * 1e3:.0f} ms",
                ]
            )
    header = ["source", "ranks", "bytes a rank", "MB at rank 0", "ms added an exchange (mean)", "95% interval",
              "of which in its calls", "longest hold, on / off (ms)", "step",
              "scoring an exchange, median / max"]  # fmt: skip
    return "\n".join(
        [
            f"## {result['title']}",
            "",
            f"`{result['command']}` — {result['date']}, one process as rank 0 of N (its tree's 4 children stood for "
            f"by blobs of real payloads of ranks as healthy as rank 0: their timings jitter 5% around its step), the "
            f"default `StragglerConfig()` with its scoring process on a core of its "
            f"own, {cfg['reps']} runs per row of {cfg['steps']} steps of Python work in slices of 0.1 ms, the "
            f"detector on and off in blocks of {cfg['block']}; {bench.load_line(result['machine'])}. CPU only.",
            "",
            bench.md_table(header, rows),
            "",
            bench.targets_table(result["targets"], digits=3),
            "",
            _growth(result),
            "",
            "*Added an exchange*: per exchange period (10 steps), the time the training thread spent in the "
            "detector's calls plus the time its slices of work were held up (beyond twice their usual length: by "
            "the interpreter lock another thread of the process holds, or by the scheduler) with the detector on, "
            "less the same hold-ups with it off. *Longest hold*: the longest such hold-up of one slice. What grows "
            "with N at rank 0 now: the kernel's copy of the bytes received into shared memory (the interpreter "
            "released; on 2 cores it can run on the training thread's). The cyclic garbage collector ran no pass "
            "during the 400 steps of a run at 16 or at 16,384 ranks, on or off (counted with `gc.callbacks`). "
            "Nothing in the training process parses or copies the records: "
            "their descriptors go to the scoring process, which maps, reads and scores them; the N-wide scores come "
            "back mapped, of the episodes only what changed. The timings are a healthy job's (every rank within "
            "5% of one step time): the scorer is not flooded with verdicts. *Scoring an exchange*: the scoring "
            "process's work on one exchange (reading the blobs, scoring its 10 steps), timed on fresh exchanges "
            "after each run; it must stay under the time between two exchanges, or exchanges queue.",
        ]
    )


def _growth(result: dict[str, Any]) -> str:
    """What the largest job adds over the smallest, this tree's (the part of an exchange that grows with N)."""
    by_n = result["arms"]["this tree"]
    small, large = (str(n) for n in (result["config"]["ranks"][0], result["config"]["ranks"][-1]))
    fixed, grown = by_n[small]["added_per_exchange_s"] * 1e3, by_n[large]["added_per_exchange_s"] * 1e3
    return (
        f"At {int(small):,} ranks ({by_n[small]['bytes_at_rank0'] / 1e3:.0f} KB reach rank 0) an exchange adds "
        f"{fixed:.1f} ms: what it costs rank 0 at any N (its calls on the 10 steps, the hand-over to the scorer, "
        f"the reply read back). From {int(small):,} to {int(large):,} ranks it grows by {grown - fixed:+.1f} ms."
    )


def readme_summary(result: dict[str, Any]) -> str:
    n = str(result["config"]["ranks"][-1])
    arm = result["arms"]["this tree"][n]
    base = result["arms"].get("baseline", {}).get(n)
    before = f", was {base['added_per_exchange_s'] * 1e3:.0f} ms" if base else ""
    return (
        f"**Rank 0 during the straggler exchange at {int(n):,} ranks** (one process standing for rank 0, CPU): "
        f"{arm['added_per_exchange_s'] * 1e3:.1f} ms added to its training thread an exchange "
        f"(every 10 steps{before}), "
        f"{arm['bytes_at_rank0'] / 1e6:.1f} MB received ({result['targets'][0]['verdict']}); its scorer takes "
        f"{arm['scoring_median_s'] * 1e3:.0f} ms an exchange (median), {result['targets'][1]['value']:.2f}x the time "
        f"between exchanges ({result['targets'][1]['verdict']})."
    )


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=4, help="runs per row (the trees take turns)")
    p.add_argument("--blocks", type=int, default=4, help="pairs of 50-step blocks (off, on) per run")
    p.add_argument("--step-ms", type=float, default=20.0, help="Python work per step on the training thread")
    p.add_argument("--baseline-tree", default=None, help="a source tree of an earlier commit, measured alike")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true", help="smoke mode: 2 sizes, one short run, nothing to publish")
    bench.add_load_argument(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return bench.run_and_publish(argv, parse, run, render_markdown, DEFAULT_OUT)


if __name__ == "__main__":
    raise SystemExit(main())
