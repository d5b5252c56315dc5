"""Where the time from a process kill to the first good step goes, under the README's launch line.

Usage (from the repository root)::

    python -m benchmarks.restart_breakdown            # the published run (about 20 minutes on 2 quiet cores)
    python -m benchmarks.restart_breakdown --quick    # smoke mode: one warm and one cold job, nothing to publish

Each run is ``lightning-resilience launch --nproc-per-node 2`` (torchrun underneath) of ``recipes.pretrain_gpt`` with
``resilience=default``, rank 1 SIGKILLed at step ``--kill-at`` of the first attempt; the launcher restarts the job,
which resumes and finishes. The runs alternate three configurations of the same commit: ``shared`` (the default:
the RAM tier in shared memory, warm restarts: standby workers that imported the script's imports, the next agent
started ahead), ``cold`` (the same with ``--no-standby``: every rank imports everything itself, each attempt's agent
starts when the attempt does) and ``process`` (``shared_memory=false``: the RAM tier dies with the process, the
restart goes back to the disk tier). From the ledger and the launcher's records, each restart's fault
to first good step is split into: detection (the last good step to the failure noticed on rank 0), teardown (to
torchrun's end of the attempt), launcher (to the next attempt's start), new processes (torchrun's agent,
rendezvous of the agents, the workers spawned: to rank 0's process start), imports (the interpreter, torch,
Lightning and the script up to its callbacks), rendezvous (process group, strategy setup), setup (callbacks, side
groups, data loaders), restore, first step; and the steps recomputed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _common as bench

MODULE = "benchmarks.restart_breakdown"
TITLE = "Restart breakdown: fault to first good step after a SIGKILL, part by part"
DEFAULT_OUT = str(bench.RESULTS_DIR / "restart_breakdown.json")
README_PENDING = f"**{TITLE}**: no result yet (`python -m {MODULE}` on a quiet machine)."
PARTS = ("detection", "teardown", "launcher", "new_processes", "imports", "rendezvous", "setup", "restore",
         "first_step")  # fmt: skip
CONFIGS: dict[str, tuple[list[str], list[str]]] = {  # name: (launcher flags, recipe overrides)
    "shared": ([], []),
    "cold": (["--no-standby"], []),
    "process": ([], ["resilience.checkpoint.tiers.0.shared_memory=false"]),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(
    run_dir: Path, config: tuple[list[str], list[str]], steps: int, kill_at: int, timeout_s: float
) -> dict[str, Any]:
    """One job with one kill; returns its restart, split into :data:`PARTS`."""
    flags, overrides = config
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "lightning_resilience.cli", "launch", "--nproc-per-node", "2", "--max-restarts", "2",
        "--master-port", str(_free_port()), "--run-dir", str(run_dir), *flags, "-m", "recipes.pretrain_gpt",
        f"run_dir={run_dir}", f"trainer.max_steps={steps}", "trainer.devices=2", "trainer.strategy=resilient_ddp",
        "resilience=default", "drill=kill_rank", f"drill.step={kill_at}", "drill.rank=1", "drill.attempt=0",
        *overrides,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(bench.REPO_ROOT)}
    proc = subprocess.run(cmd, cwd=bench.REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    (run_dir / "job.log").write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"the job failed (exit code {proc.returncode}); logs in {run_dir / 'job.log'}")
    return breakdown(run_dir)


def breakdown(run_dir: Path) -> dict[str, Any]:
    """The first restart of ``run_dir``: the ledger's parts, with its relaunch split by the launcher's records."""
    ledger = json.loads((run_dir / "resilience" / "ft_ledger.json").read_text())
    prev, cur = ledger["attempts"][0], ledger["attempts"][1]
    launched = [json.loads(line) for line in (run_dir / "launch" / "attempts.jsonl").read_text().splitlines()]
    attempts = sorted((r for r in launched if r.get("kind") == "attempt"), key=lambda r: r["attempt"])
    fault = prev["last_heartbeat_at"]
    restore = float(cur.get("restore_s") or 0.0)
    marks = [
        ("detection", prev.get("ended_at")),
        ("teardown", attempts[0]["ended_at"]),
        ("launcher", attempts[1]["started_at"]),
        ("new_processes", cur.get("process_started_at")),
        ("imports", cur.get("script_ready_at")),
        ("rendezvous", cur["started_at"]),
        ("setup", cur["restored_at"] - restore if cur.get("restored_at") else None),
        ("restore", cur.get("restored_at")),
        ("setup", cur["first_step_at"]),
        ("first_step", cur.get("first_step_done_at")),
    ]
    parts = dict.fromkeys(PARTS, 0.0)
    at = fault
    for part, mark in marks:
        if mark is not None and mark >= at:
            parts[part] += mark - at
            at = mark
    return {
        "parts_s": parts,
        "total_s": at - fault,
        "steps_lost": max(int(prev["last_step"]) - int(cur["start_step"]), 0),
        "restored_step": cur.get("restored_step"),
        "restored_from": cur.get("restored_from"),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--runs", type=int, default=None, help="jobs per configuration (default 5; quick: 1)")
    p.add_argument("--steps", type=int, default=40, help="steps of each job")
    p.add_argument("--kill-at", type=int, default=27, help="the step rank 1 is killed at (not a disk step)")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on one job, seconds")
    p.add_argument("--tmpdir", default=None, help="where the jobs run (default: the temp dir)")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    p.add_argument("--quick", action="store_true", help="smoke mode: one warm and one cold job, nothing published")
    args = p.parse_args(argv)
    args.runs = args.runs or (1 if args.quick else 5)
    return args


def _median_parts(runs: list[dict[str, Any]]) -> dict[str, Any]:
    parts = {p: statistics.median(r["parts_s"][p] for r in runs) for p in PARTS}
    total = statistics.median(r["total_s"] for r in runs)
    return {
        "runs": runs,
        "median_parts_s": parts,
        "median_total_s": total,
        "shares": {p: (v / total if total > 0 else None) for p, v in parts.items()},
        "median_steps_lost": statistics.median(r["steps_lost"] for r in runs),
        "restored_from": sorted({str(r["restored_from"]) for r in runs}),
    }


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="lr-restart-bench-", dir=args.tmpdir))
    machine = bench.machine_info()
    configs = {n: CONFIGS[n] for n in ("shared", "cold")} if args.quick else CONFIGS
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    try:
        for i in range(args.runs):
            for name, config in configs.items() if i % 2 == 0 else list(configs.items())[::-1]:
                start = time.perf_counter()
                r = run_job(root / f"{name}_{i}", config, args.steps, args.kill_at, args.timeout)
                results[name].append(r)
                bench.print_flush(f"[{MODULE}] {name} run {i}: fault to first good step {r['total_s']:.2f} s, "
                            f"{r['steps_lost']} steps lost (job {time.perf_counter() - start:.0f} s)")  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    machine["loadavg_at_end"] = list(os.getloadavg())
    summary = {name: _median_parts(runs) for name, runs in results.items()}
    shared = summary["shared"]
    return {
        "benchmark": "restart_breakdown",
        "title": TITLE,
        "date": bench.now_iso(),
        "command": bench.command_line(MODULE, argv),
        "quick": args.quick,
        "machine": machine,
        "config": {"runs": args.runs, "steps": args.steps, "kill_at": args.kill_at},
        "configs": summary,
        "targets": [
            bench.target(
                "fault to first good step after a process kill (median)", shared["median_total_s"], "<=", 2.0, " s"
            ),
            bench.target("steps recomputed after a process kill (median)", shared["median_steps_lost"], "<=", 1.0, ""),
        ],
    }


def render_markdown(result: dict[str, Any]) -> str:
    configs = result["configs"]
    rows = []
    for part in PARTS:
        row = [part.replace("_", " ")]
        for name in configs:
            c = configs[name]
            share = c["shares"][part]
            row.append(f"{c['median_parts_s'][part]:.2f} s ({100 * share:.0f}%)" if share is not None else "-")
        rows.append(row)
    rows.append(["**total**", *(f"**{configs[n]['median_total_s']:.2f} s**" for n in configs)])
    rows.append(["steps recomputed", *(f"{configs[n]['median_steps_lost']:g}" for n in configs)])
    rows.append(["restored from", *(", ".join(configs[n]["restored_from"]) for n in configs)])
    header = (
        f"`{result['command']}` ({result['date']}; {result['config']['runs']} jobs per configuration, medians; "
        f"{bench.load_note(result)})."
    )
    return "\n".join(
        [
            f"## {TITLE}",
            "",
            header,
            "",
            bench.md_table(["part", *configs], rows),
            "",
            bench.targets_table(result["targets"], digits=2),
            "",
        ]
    )


def readme_summary(result: dict[str, Any]) -> str:
    c = result["configs"]["shared"]
    top = sorted(c["shares"].items(), key=lambda kv: -(kv[1] or 0))[:3]
    parts = ", ".join(f"{name.replace('_', ' ')} {100 * (share or 0):.0f}%" for name, share in top)
    return (
        f"**restart after a process kill** (2 CPU ranks, `lightning-resilience launch`, the default preset): "
        f"{c['median_total_s']:.1f} s from the fault to the first good step, {c['median_steps_lost']:g} steps "
        f"recomputed; the largest parts: {parts}."
    )


def main(argv: Sequence[str] | None = None) -> int:
    return bench.run_and_publish(argv, parse_args, run, render_markdown, DEFAULT_OUT)


if __name__ == "__main__":
    raise SystemExit(main())
