"""Recovery from faults under ``torchrun --max-restarts``: detection time, restart time and lost work per fault type.

Run from the repository root::

    python -m benchmarks.ft_recovery            # every fault type, 24 steps
    python -m benchmarks.ft_recovery --quick    # smoke mode: a hang and a preemption, 12 steps

Each fault runs the drill workload ``tests/ft/_ft_script.py`` (TinyGPT on 2 CPU ranks, gloo, ``FaultTolerance`` +
``TieredCheckpoint`` with a RAM tier every step and a disk tier every 5 steps) with one fault injected on rank 1 in
the first attempt; torchrun restarts the group and the job resumes on its own. The figures come from the run's ETTR
ledger and fault notes (wall clock of the ranks, not of this process):

* **detection**: a hang: how long the stuck section had been open when its rank's watchdog fired (the calibrated
  timeout plus the watchdog's wake-up); an exception: 0 (it raises); a preemption: signal to the agreed stop
  boundary (the emergency save included); a SIGKILL: not observable by the ranks (the launcher sees the exit).
* **restart**: last heartbeat of the failed attempt to the first step of the next, minus detection: teardown,
  relaunch of the processes (imports), rendezvous, process-group set-up and restore.
* **lost work**: steps redone after the resume x step time.

Baselines, same run: the cold start of an uninterrupted run (process launch to first step, from torchrun's start),
and, for detection, the uncalibrated default step timeout of the config (what a hang would cost without
calibration). An in-process restart (NVRx ``inprocess.Wrapper``) is not measured: see docs/fault-tolerance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import (
    REPO_ROOT,
    RESULTS_DIR,
    command_line,
    fmt_ratio,
    machine_info,
    md_table,
    now_iso,
    print_flush,
    ratio,
    target,
    write_json,
)
from lightning_resilience.ft.config import FaultToleranceConfig

MODULE = "benchmarks.ft_recovery"
DEFAULT_OUT = RESULTS_DIR / "ft_recovery.json"
TITLE = "Fault tolerance: detection time, restart time and lost work per fault type"
SCRIPT = REPO_ROOT / "tests" / "ft" / "_ft_script.py"
FAULTS = ("exception", "sigkill", "hang-loop", "hang-collective", "sigterm")
QUICK_FAULTS = ("hang-loop", "sigterm")
TORCHRUN_TIMEOUT_S = 420
LIBRARY_MIN_TIMEOUT_S = FaultToleranceConfig().min_timeout_s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(run_dir: Path, steps: int, min_timeout: float, *args: str) -> tuple[float, str]:
    """Run the drill workload once (with its restarts); returns torchrun's wall time and its stderr."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(SCRIPT),
        "--run-dir", str(run_dir), "--steps", str(steps), "--min-timeout", str(min_timeout), *args,
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S)
    wall = time.time() - start
    (run_dir / "torchrun.log").write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun {' '.join(args)} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return wall, proc.stderr


def _ledger(run_dir: Path) -> list[dict[str, Any]]:
    return list(json.loads((run_dir / "ft" / "ft_ledger.json").read_text())["attempts"])


def _final_report(run_dir: Path) -> dict[str, Any]:
    attempts = sorted((run_dir / "reports").glob("attempt*_rank0.json"))
    return dict(json.loads(attempts[-1].read_text()))


def measure_fault(run_dir: Path, fault: str, steps: int, fault_step: int, min_timeout: float) -> dict[str, Any]:
    wall, stderr = torchrun(run_dir, steps, min_timeout, "--fault", fault, "--fault-step", str(fault_step))
    ledger = _ledger(run_dir)
    if len(ledger) != 2 or ledger[1]["end_reason"] != "finished":
        raise RuntimeError(f"{fault}: expected one restart that finished, ledger: {ledger}")
    first, second = ledger
    faults = sorted(first["faults"], key=lambda f: f["detected_at"])
    detection: float | None
    if fault.startswith("hang"):
        hangs = [f for f in faults if f["kind"] == "hang"]
        detection = float(hangs[0]["detection_s"])
    elif fault == "sigterm":
        (note,) = [f for f in faults if f["kind"] == "preemption"]
        detection = float(first["ended_at"] - note["detected_at"])
    elif fault == "exception":
        detection = 0.0
    else:
        detection = None  # a SIGKILLed rank notes nothing; the launcher sees the exit
    gap = float(second["first_step_at"] - first["last_heartbeat_at"])
    ettr = _final_report(run_dir)["ft"]["ettr"]
    step_s = (first["last_heartbeat_at"] - first["first_step_at"]) / max(first["steps"], 1)
    return {
        "fault": fault,
        "fault_step": fault_step,
        "end_reason": first["end_reason"],
        "detection_s": detection,
        "restart_gap_s": gap,
        "restart_s": gap - (detection or 0.0),
        "recomputed_steps": ettr["recomputed_steps"],
        "recompute_s": ettr["recompute_s"],
        "lost_s": gap + ettr["recompute_s"],
        "step_s": step_s,
        "resumed_from": second["start_step"],
        "timeout_s": next((f["timeout_s"] for f in faults if f["kind"] == "hang"), None),
        "ettr": ettr["ettr"],
        "torchrun_wall_s": wall,
        "exit_codes": sorted({int(c) for c in _exit_codes(stderr)}),
    }


def _exit_codes(stderr: str) -> list[str]:
    out = []
    for part in stderr.split("exitcode: ")[1:]:
        code = part.split(")")[0].split()[0]
        if code.lstrip("-").isdigit():
            out.append(code)
    return out


def measure_reference(run_dir: Path, steps: int, min_timeout: float) -> dict[str, Any]:
    launched = time.time()
    wall, _ = torchrun(run_dir, steps, min_timeout)
    (attempt,) = _ledger(run_dir)
    return {
        "torchrun_wall_s": wall,
        "cold_start_s": attempt["first_step_at"] - launched,  # process launch, imports, rendezvous, set-up
        "step_s": (attempt["last_heartbeat_at"] - attempt["first_step_at"]) / max(attempt["steps"], 1),
    }


def render_markdown(result: dict[str, Any]) -> str:
    rows = []
    for f in result["faults"].values():
        rows.append(
            [
                f["fault"],
                "n/a (launcher)" if f["detection_s"] is None else f"{f['detection_s']:.2f} s",
                f"{f['restart_s']:.1f} s",
                f"{f['recomputed_steps']} steps ({f['recompute_s']:.2f} s)",
                f"{f['lost_s']:.1f} s",
                ", ".join(str(c) for c in f["exit_codes"]) or "-",
            ]
        )
    lines = [
        f"## {TITLE}",
        "",
        f"Command: `{result['command']}` ({result['date']}, {result['machine']['cpu_count']} CPUs, "
        f"torch {result['machine']['torch']})",
        "",
        md_table(["fault", "detection", "restart (cold)", "recomputed", "lost (gap + recompute)", "exit codes"], rows),
        "",
        f"Cold start of an uninterrupted run: {result['reference']['cold_start_s']:.1f} s. Calibrated timeouts: "
        f"{_floor_note(result['config'])}; before calibration the step timeout is "
        f"{result['config']['default_step_timeout_s']:.0f} s.",
        "",
        md_table(
            ["target", "value", "goal", "verdict"],
            [
                [t["name"], "n/a" if t["value"] is None else f"{t['value']:.2f}{t['unit']}", f"{t['op']} "
                 f"{t['threshold']}{t['unit']}", t["verdict"]]
                for t in result["targets"]
            ],
        ),
        "",
    ]  # fmt: skip
    return "\n".join(lines)


def _floor_note(cfg: dict[str, Any]) -> str:
    floor, library = cfg["min_timeout_s"], cfg.get("library_default_min_timeout_s", LIBRARY_MIN_TIMEOUT_S)
    if floor == library:
        return f"the library defaults (never below {floor:g} s)"
    return f"**a {floor:g} s floor set for this run** (the library default is {library:g} s: not a published figure)"


def readme_summary(result: dict[str, Any]) -> str:
    faults, cfg = result["faults"], result["config"]
    hangs = [f["detection_s"] for k, f in faults.items() if k.startswith("hang") and f["detection_s"] is not None]
    restarts = [f["restart_s"] for f in faults.values()]
    text = "**fault tolerance** (2 CPU ranks under torchrun): "
    if hangs:
        text += f"a hang is detected in {max(hangs):.0f} s with {_floor_note(cfg)}; "
    if restarts:
        text += (
            f"a restart takes {min(restarts):.0f}-{max(restarts):.0f} s (a cold start: "
            f"{result['reference']['cold_start_s']:.0f} s)"
        )
    sigterm = faults.get("sigterm")
    if sigterm:
        text += f"; a preemption is saved and stopped with {sigterm['recomputed_steps']} steps recomputed"
    return text + "."


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=None, help="fault types (all; quick: 2)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (24; quick: 12)")
    p.add_argument("--fault-step", type=int, default=None, help="step of the fault (14; quick: 7)")
    p.add_argument(
        "--min-timeout", type=float, default=None,
        help=f"floor of calibrated timeouts (s); default: the library's ({LIBRARY_MIN_TIMEOUT_S:g}; quick: 4)",
    )  # fmt: skip
    p.add_argument("--tmpdir", default=None, help="where runs are written (default: system temp dir)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON result file")
    p.add_argument("--quick", action="store_true", help="smoke mode: a hang and a preemption, 12 steps")
    args = p.parse_args(argv)
    args.faults = args.faults or list(QUICK_FAULTS if args.quick else FAULTS)
    args.steps = args.steps or (12 if args.quick else 24)
    args.fault_step = args.fault_step or (7 if args.quick else 14)
    if args.min_timeout is None:  # the published figures use the library default; only smoke runs go faster
        args.min_timeout = 4.0 if args.quick else LIBRARY_MIN_TIMEOUT_S
    if not 5 < args.fault_step < args.steps - 2:
        p.error("--fault-step must be past the first persisted step (5) and before the last two steps")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv) if argv is not None else None
    args = parse_args(argv)
    start = time.time()
    root = Path(tempfile.mkdtemp(prefix="lr-ft-bench-", dir=args.tmpdir))
    try:
        print_flush(f"[ft] reference run: {args.steps} steps on 2 ranks")
        reference = measure_reference(root / "reference", args.steps, args.min_timeout)
        faults: dict[str, Any] = {}
        for fault in args.faults:
            print_flush(f"[ft] {fault} at step {args.fault_step} on rank 1")
            faults[fault] = measure_fault(root / fault, fault, args.steps, args.fault_step, args.min_timeout)
            f = faults[fault]
            print_flush(
                f"[ft]   detection {f['detection_s']} s, restart {f['restart_s']:.1f} s, "
                f"recomputed {f['recomputed_steps']} steps, exit codes {f['exit_codes']}"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    default_timeout = FaultToleranceConfig().initial_timeouts_s["step"]
    hang_detection = [f["detection_s"] for k, f in faults.items() if k.startswith("hang")]
    restarts = [f["restart_s"] for f in faults.values()]
    ratios = {
        "default_timeout_over_hang_detection": ratio(default_timeout, max(hang_detection) if hang_detection else None),
        "restart_over_cold_start": ratio(max(restarts), reference["cold_start_s"]),
    }
    sigterm = faults.get("sigterm")
    targets = [
        target(
            f"hang detected within the calibrated timeout (floor {args.min_timeout:g} s) + 5 s",
            max(hang_detection) if hang_detection else None,
            "<=",
            args.min_timeout + 5.0,
            " s",
        ),
        target(
            "preemption loses no step (recomputed after the resume)",
            float(sigterm["recomputed_steps"]) if sigterm else None,
            "<=",
            0.0,
        ),
        target("restart costs at most 3x a cold start", ratios["restart_over_cold_start"], "<=", 3.0, "x"),
    ]
    result = {
        "benchmark": "ft_recovery",
        "command": command_line(MODULE, sys.argv[1:] if argv is None else argv),
        "date": now_iso(),
        "machine": machine_info(),
        "config": {
            "quick": args.quick,
            "steps": args.steps,
            "fault_step": args.fault_step,
            "fault_rank": 1,
            "world_size": 2,
            "min_timeout_s": args.min_timeout,
            "library_default_min_timeout_s": LIBRARY_MIN_TIMEOUT_S,
            "default_step_timeout_s": default_timeout,
            "workload": "tests/ft/_ft_script.py: TinyGPT tiny, gloo, MemoryTier every step, LocalTier every 5",
            "launcher": "torchrun --max-restarts 2 (c10d rendezvous, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)",
        },
        "reference": reference,
        "faults": faults,
        "ratios": ratios,
        "targets": targets,
        "notes": (
            "Times come from the ranks' wall clocks in the run's ledger. Restart = gap between the failed attempt's "
            "last heartbeat and the resumed attempt's first step, minus detection: on this CPU machine it is "
            "dominated by relaunching Python processes (imports of torch and lightning) on 2 shared cores. "
            "An in-process restart was not measured."
        ),
        "wall_s": time.time() - start,
    }
    out = write_json(args.out, result)
    print_flush("")
    print_flush(render_markdown(result))
    print_flush(
        f"[ft] ratios: default timeout / hang detection {fmt_ratio(ratios['default_timeout_over_hang_detection'])}"
    )
    print_flush(f"[ft] wrote {out} in {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
