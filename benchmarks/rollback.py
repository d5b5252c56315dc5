"""In-process rollback against a restart: time from the verdict to the first good step, in the same job.

Run from the repository root::

    python -m benchmarks.rollback            # 3 interleaved repetitions of each path, 30 steps, 256 hidden units
    python -m benchmarks.rollback --quick    # smoke mode: 1 repetition, 20 steps

The job is the drill's user script on 2 CPU ranks under torchrun (``benchmarks/_rollback_job.py``: the default
preset, ``DataLoader(shuffle=True)``, DDP, an MLP) with one sample whose features are NaN in the first attempt.
SDC's guards see it one step late; both paths start from the same verdict, taken at the same step boundary:

* **in-process** (``policy.nonfinite=rollback_in_process``, the default): the RAM snapshot before the bad step is
  restored in the running process and its batch skipped;
* **restart** (``policy.nonfinite=rollback``, the best a restart can do here): the job stops without saving,
  torchrun restarts the group (``--max-restarts 1``), and the new attempt resumes from the newest committed disk
  step verified clean (the preset's local tier every 10 steps, reconciliation every 10 steps in both paths).

Figures (rank 0's wall clock, the end of each training step): **to first good step**, from the end of the step at
which the ranks decided to the end of the first step after the recovery; **to regained progress**, to the end of
the first step that reaches the deciding step's number again (lost steps redone). The ratio is restart /
in-process. CPU only, a small model: the restart's cost is mostly process start, imports and rendezvous, which do
not shrink with the model, while a RAM restore grows with the state (a host-to-host copy here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import (
    REPO_ROOT,
    RESULTS_DIR,
    command_line,
    fmt_ms,
    fmt_ratio,
    machine_info,
    md_table,
    now_iso,
    print_flush,
    ratio,
    summarize,
    target,
    write_json,
)
from tests._ranks import free_port

MODULE = "benchmarks.rollback"
DEFAULT_OUT = RESULTS_DIR / "rollback.json"
TITLE = "In-process rollback: verdict to first good step, against a restart of the same job"
JOB = REPO_ROOT / "benchmarks" / "_rollback_job.py"
PATHS = {
    "in_process": ["resilience.policy.config.nonfinite=rollback_in_process"],
    "restart": ["resilience.policy.config.nonfinite=rollback"],
}
COMMON = ["resilience.sdc.config.reconcile_every_n_steps=10"]


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=TITLE)
    p.add_argument("--quick", action="store_true", help="smoke mode: 1 repetition, 20 steps")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--bad-step", type=int, default=14, help="the step whose batch holds the NaN sample (rank 1)")
    p.add_argument("--timeout", type=float, default=300.0, help="bound on each job (seconds)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 3)
    args.steps = args.steps or (20 if args.quick else 30)
    if not 2 <= args.bad_step <= args.steps - 4:
        p.error(f"--bad-step must be in [2, steps - 4 = {args.steps - 4}], got {args.bad_step}")
    return args


def _poison(bad_step: int) -> int:
    """A sample of rank 1's batch at ``bad_step`` of epoch 0 (Lightning's DistributedSampler, seed 1234)."""
    from torch.utils.data import DistributedSampler

    from tests.drills._user_code import AugmentedPoints

    sampler = DistributedSampler(AugmentedPoints(), num_replicas=2, rank=1, shuffle=True, seed=1234)
    sampler.set_epoch(0)
    return list(sampler)[bad_step * 8 + 3]


def _run(path: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(JOB), str(run_dir),
        str(args.steps), str(_poison(args.bad_step)), str(args.hidden), *COMMON, *PATHS[path],
    ]  # fmt: skip
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=args.timeout)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{path} job failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    times = []
    for f in sorted((run_dir / "times").glob("attempt*_rank0.jsonl")):
        times += [json.loads(line) for line in f.read_text().splitlines()]
    times.sort(key=lambda e: e["t"])
    return _figures(times, path)


def _figures(times: list[dict[str, Any]], path: str) -> dict[str, Any]:
    """The deciding step is the last one before the step count goes back (a rollback, or the next attempt)."""
    i = next((k for k in range(len(times) - 1) if times[k + 1]["step"] <= times[k]["step"]), None)
    if i is None:
        raise RuntimeError(f"{path}: no recovery in the step times")
    decided = times[i]
    first_good = times[i + 1]
    regained = next(e for e in times[i + 1 :] if e["step"] >= decided["step"])
    return {
        "decided_step": decided["step"],
        "resumed_step": first_good["step"] - 1,
        "attempts": 1 + max(e["attempt"] for e in times),
        "first_good_s": first_good["t"] - decided["t"],
        "regained_s": regained["t"] - decided["t"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    runs: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
    root = Path(tempfile.mkdtemp(prefix="lr-rollback-bench-"))
    try:
        for rep in range(args.reps):
            for path in PATHS:  # interleaved: both paths see the same machine state
                runs[path].append(_run(path, args, root / f"{path}{rep}"))
                print_flush(f"repetition {rep + 1}/{args.reps} {path}: {runs[path][-1]}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures = {
        path: {key: summarize(r[key] for r in rs) for key in ("first_good_s", "regained_s")}
        for path, rs in runs.items()
    }
    med = {path: {k: v["median_s"] for k, v in f.items()} for path, f in figures.items()}
    speedup = ratio(med["restart"]["first_good_s"], med["in_process"]["first_good_s"])
    result: dict[str, Any] = {
        "title": TITLE,
        "command": command_line(MODULE, argv),
        "when": now_iso(),
        "machine": machine_info(),
        "steps": args.steps,
        "bad_step": args.bad_step,
        "hidden": args.hidden,
        "reps": args.reps,
        "runs": runs,
        "figures": figures,
        "ratios": {
            "first_good": speedup,
            "regained": ratio(med["restart"]["regained_s"], med["in_process"]["regained_s"]),
        },
        "targets": [
            target(
                "restart / in-process, verdict to first good step",
                speedup,
                ">=",
                10.0,
                "x",
                "CPU only; 2 ranks under torchrun",
            ),
        ],
    }
    out = write_json(args.out, result)
    print_flush(render_markdown(result))
    print_flush(f"wrote {out}")
    return 0


def render_markdown(result: dict[str, Any]) -> str:
    f, q = result["figures"], result["ratios"]
    rows = []
    for path, label in (("in_process", "in-process rollback (RAM)"), ("restart", "restart (torchrun, disk)")):
        rows.append(
            [
                label,
                fmt_ms(f[path]["first_good_s"]["median_s"]),
                fmt_ms(f[path]["first_good_s"]["max_s"]),
                fmt_ms(f[path]["regained_s"]["median_s"]),
                ", ".join(str(r["resumed_step"]) for r in result["runs"][path]),
            ]
        )
    return "\n".join(
        [
            f"## {result['title']}",
            "",
            f"`{result['command']}` — {result['when']}, {result['reps']} interleaved repetitions (median), "
            f"{result['steps']} steps, NaN sample at step {result['bad_step']} on rank 1, MLP with "
            f"{result['hidden']} hidden units, 2 CPU ranks (gloo) under torchrun; CPU only.",
            "",
            "From the end of the step at which the ranks decided to the end of the first good step after the "
            "recovery, and to the end of the step that regains the deciding step's number (lost steps redone).",
            "",
            md_table(["path", "to first good step", "max", "to regained progress", "resumed from step"], rows),
            "",
            f"Restart / in-process: **{fmt_ratio(q['first_good'])}** to the first good step, "
            f"{fmt_ratio(q['regained'])} to regained progress.",
            "",
        ]
    )


def readme_summary(result: dict[str, Any]) -> str:
    f, q = result["figures"], result["ratios"]
    return (
        f"**in-process rollback**: verdict to first good step (2 CPU ranks, same job): "
        f"{fmt_ms(f['in_process']['first_good_s']['median_s'])} against "
        f"{fmt_ms(f['restart']['first_good_s']['median_s'])} for a restart of the same job, "
        f"{fmt_ratio(q['first_good'])} faster."
    )


if __name__ == "__main__":
    sys.exit(main())
