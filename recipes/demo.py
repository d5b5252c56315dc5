"""`make demo`: train a small GPT on 2 ranks under `lightning-resilience launch` (torchrun underneath, the static
rendezvous users type), SIGKILL a rank mid-run, let the launcher restart the job, resume automatically from the
newest step every rank holds (the snapshots in shared memory outlive the killed processes), and print what was
saved, restored, what it cost, and what the launcher recorded."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from lightning_resilience.ft.restart_cost import describe_restart
from lightning_resilience.launch.records import AttemptRecord, read_records

RUN_DIR = Path(os.environ.get("DEMO_RUN_DIR", "runs/demo"))
STEPS, KILL_AT, LOCAL_EVERY = 80, 47, 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _attempt_line(a: AttemptRecord) -> str:
    took = a.ended_at - a.started_at
    if a.cause is None:
        what = "every rank finished"
    else:
        how = f"killed by {a.cause.detail}" if a.cause.kind == "signal" else f"{a.cause.kind} {a.cause.detail}"
        victims = ", ".join(f"rank {r.rank} {r.how()[1]}" for r in a.ranks if r.role == "victim")
        what = f"cause: rank {a.cause.rank} {how}" + (f"; victims: {victims}" if victims else "")
    steps = f"committed step {a.step_at_start if a.step_at_start is not None else 'none'} -> {a.step_at_end}"
    return f"attempt {a.attempt}: {a.outcome} after {took:.1f} s; {what}; {steps}; launcher: {a.reason}"


def main() -> int:
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    RUN_DIR.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "lightning_resilience.cli", "launch",
        "--nproc-per-node", "2", "--max-restarts", "2", "--master-port", str(free_port()), "--run-dir", str(RUN_DIR),
        "-m", "recipes.pretrain_gpt",
        f"run_dir={RUN_DIR}", f"trainer.max_steps={STEPS}", "trainer.devices=2", "trainer.strategy=resilient_ddp",
        "resilience=default", f"resilience.checkpoint.tiers.1.every_n_steps={LOCAL_EVERY}",
        "drill=kill_rank", f"drill.step={KILL_AT}", "drill.rank=1", "drill.attempt=0",
    ]  # fmt: skip
    shown = ["lightning-resilience", *cmd[3:]]
    print("$", " ".join(shown), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path.cwd())}
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, timeout=900)
    wall = time.perf_counter() - started
    report_file = RUN_DIR / "report.jsonl"
    reports = [json.loads(line) for line in report_file.read_text().splitlines()] if report_file.exists() else []
    attempts = [r for r in read_records(RUN_DIR / "launch") if isinstance(r, AttemptRecord)]
    print("\n==================== resilience report ====================")
    print(f"job: 2 ranks, {STEPS} steps, rank 1 SIGKILLed at step {KILL_AT} (attempt 0)")
    print(f"launcher exit code {proc.returncode}; its records ({RUN_DIR / 'launch' / 'attempts.jsonl'}):")
    for a in attempts:
        print(f"  {_attempt_line(a)}")
    for r in reports:
        local = r["tiers"].get("local", {})
        print(
            f"attempt {r['attempt']}: finished at step {r['final_step']}, loss {r['final_loss']:.4f}; "
            f"{r['snapshots']} RAM snapshots of {r['state_mib']:.1f} MiB, blocking mean {r['blocking_ms_mean']:.2f} ms "
            f"(max {r['blocking_ms_max']:.2f}) = {100 * r['blocking_ms_mean'] / max(r['median_step_ms'], 1e-9):.2f}% "
            f"of a {r['median_step_ms']:.1f} ms step; {local.get('writes', 0)} disk persists, "
            f"{local.get('failures', 0)} failed"
        )
        if r["restored_step"] is not None:
            print(
                f"           resumed from step {r['restored_step']} ({r['restored_from']} tier) in "
                f"{r['restore_ms']:.1f} ms; work lost to the crash: {KILL_AT - r['restored_step']} steps"
            )
    print(f"wall time including the restart: {wall:.1f} s")
    explain_restarts(RUN_DIR)
    came_up = len(attempts) == 2 and attempts[0].cause is not None and attempts[0].cause.detail == "SIGKILL"
    ok = (
        proc.returncode == 0
        and came_up
        and any(r["restored_step"] for r in reports)
        and bool(reports)
        and reports[-1]["final_step"] == STEPS
    )
    print("demo:", "PASSED (crashed, restarted, resumed, finished)" if ok else "FAILED")
    return 0 if ok else 1


def explain_restarts(run_dir: Path) -> None:
    """Why each attempt ended (the culprit rank, how, the victims) and where the goodput timeline is."""
    path = run_dir / "resilience_report.json"
    if not path.is_file():
        print(f"no resilience report in {run_dir}")
        return
    report = json.loads(path.read_text())
    for attempt in report.get("attempts", []):
        print(f"attempt {attempt['attempt']} ended: {attempt['headline']}")
        for victim in (attempt.get("victims") or [])[:4]:
            print(f"           victim: rank {victim['rank']}: {victim['brief']}")
    for cost in (report.get("timeline") or {}).get("ettr", {}).get("restart_costs") or []:
        print(f"restart {cost['attempt']}: {describe_restart(cost)}")
    timeline = run_dir / "timeline.png"
    print(f"goodput timeline: {timeline}" if timeline.is_file() else "no timeline picture (matplotlib not installed)")
    print(f"full report: {path} (again: lightning-resilience report {run_dir})")


if __name__ == "__main__":
    sys.exit(main())
