"""Does the simulator predict the ETTR of a real fault-injected training run?

Run from the repository root::

    python -m benchmarks.sim_validation            # two runs of 600 steps, ~5 kills each, about nine minutes
    python -m benchmarks.sim_validation --quick    # two runs of 250 steps, 2-4 kills each, about four minutes

A tiny GPT trains on 2 CPU ranks (gloo) under ``torchrun --max-restarts``, with ``TieredCheckpoint`` persisting to a
``LocalTier`` every K steps. Kill times are drawn up front from a Poisson process (mean ``--mttf`` seconds of wall
time, counted from the end of the first checkpoint interval); a thread of rank 1 SIGKILLs its process at each one,
whatever the job is doing (training, restarting or restoring), torchrun restarts the job and it resumes from the
newest committed checkpoint. The run ends when ``--steps`` steps are done.

Measured: wall time (end of the first checkpoint interval of the first attempt to the last step of the last),
productive time (steps x the mean step time at full speed), hence the ETTR; and from the same run the costs the
simulator needs: mean step time, blocking per checkpoint (checkpoint steps minus the others), background write time,
restore time, and restart time (kill until training is back at full speed, restore excluded). They are written
to ``<run dir>/resilience_report.json`` (the ``simulate --from-run`` schema) and read back through
``load_run_costs``, so the prediction uses exactly that path.

Two independent runs: the **calibration run** (A) gives the costs; the **validation run** (B: another training seed
and another kill schedule drawn with the same MTTF) is predicted from A's costs only. Predicted for B: (1) the
simulator's mean over many random Poisson draws at the scheduled MTTF (what a user would get before running
anything), (2) the simulator replaying B's kill times (B's failures as input, A's costs). A's own prediction is
shown as the in-sample reference. Printed: the ETTRs and the gaps in points.
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

from benchmarks._sim_worker import read_events

MODULE = "benchmarks.sim_validation"
DEFAULT_OUT = "benchmarks/results/sim_validation.json"
TITLE = "Simulator against a real fault-injected run on this machine (ETTR)"
TARGET_GAP_POINTS = 5.0
WORLD_SIZE = 2
RESUME_STEPS = 5
WORKER = Path(__file__).with_name("_sim_worker.py")
"""One rank of one attempt, started by torchrun (its event log is what :func:`measure` reads)."""

# ------------------------------------------------------------------------------------------------------------------
# driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(
    run: Path, steps: int, every: int, restarts: int, timeout: float, train_seed: int
) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parent.parent
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD_SIZE),
        "--max-restarts", str(restarts), "--monitor-interval", "0.1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
        str(WORKER), "--run-dir", str(run), "--steps", str(steps), "--every", str(every),
        "--train-seed", str(train_seed),
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        # a restarted rank must not read its dead peer's address from the previous attempt's store (pytorch#135712)
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    (run / "torchrun.log").write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(
            f"torchrun failed (rc={proc.returncode}); see {run / 'torchrun.log'}:\n{proc.stderr[-3000:]}"
        )
    return proc


def measure(run: Path, steps: int, every: int) -> dict[str, Any]:
    """Wall time, productive time, ETTR and the unit costs, from the event logs of both ranks.

    The clock starts at the end of step ``every`` of the first attempt (start-up and first-step warm-up are not
    what the simulator models), so the productive work is ``steps - every`` steps. A restart costs from the kill
    until training is back at full speed: ``RESUME_STEPS`` steps after the resume, less their median duration
    (the slow first steps after a restart are part of it, as TrainMover counts warm-up). Its mean over the kills
    whose next attempt trained is the restart cost; ``down_s`` is what is left of the wall time once productive
    steps, lost steps and checkpoint blocking are taken out.
    """
    r0 = read_events(run / "events_rank0.jsonl")
    r1 = read_events(run / "events_rank1.jsonl")
    t0 = float(json.loads((run / "t0.json").read_text())["t0"])
    step_ev = [e for e in r0 if e["event"] == "step"]
    firsts = {e["attempt"]: e for e in r0 if e["event"] == "first_batch"}
    kills = [e for e in r1 if e["event"] == "kill"]
    end = next(e for e in r0 if e["event"] == "end")
    wall = float(end["t"]) - t0

    # step durations within an attempt, the first RESUME_STEPS of each attempt (warm-up) left out
    durations: dict[int, list[float]] = {}
    prev: dict[int, tuple[float, int]] = {}
    for e in step_ev:
        a = e["attempt"]
        if a in prev and e["step"] - firsts[a]["step"] > RESUME_STEPS:
            durations.setdefault(e["step"], []).append(e["t"] - prev[a][0])
        prev[a] = (e["t"], e["step"])
    plain = [d for s, ds in durations.items() if s % every for d in ds]
    ckpt = [d for s, ds in durations.items() if s % every == 0 for d in ds]
    # means, not medians: the simulator's step time must reproduce the total time spent training
    step_s = statistics.fmean(plain)
    blocking_s = max(0.0, statistics.fmean(ckpt) - step_s) if ckpt else 0.0

    restarts, restores, lost_steps = [], [], 0
    resumed_at = {a: int(e["restored_step"] or 0) for a, e in firsts.items()}
    for k in kills:
        a = k["attempt"]
        if k["step"] is not None and a in firsts:  # killed while training: steps since the restore point are lost
            nxt = min((b for b in firsts if b > a), default=None)
            lost_steps += int(k["step"]) - (resumed_at[nxt] if nxt is not None else int(k["step"]))
        nxt_first = firsts.get(a + 1)
        if nxt_first is None or any(x["attempt"] == a + 1 and x["step"] is None for x in kills):
            continue  # the next attempt was killed before it trained: no clean restart sample
        restore = float(nxt_first["restore_s"] or 0.0)
        resumed = resumed_at[a + 1]
        after = [e for e in step_ev if e["attempt"] == a + 1 and e["step"] <= resumed + RESUME_STEPS]
        back = max(after, key=lambda e: e["step"]) if after else {"t": nxt_first["t"], "step": resumed}
        outage = float(back["t"]) - float(k["t"]) - (int(back["step"]) - resumed) * step_s
        restores.append(restore)
        restarts.append(outage - restore)
    local = end["tiers"].get("local", {})
    write_s = float(local.get("seconds", 0.0)) / max(1, int(local.get("writes", 0) or 0))
    productive = (steps - every) * step_s
    checkpoint = (steps // every - 1) * blocking_s
    return {
        "wall_s": wall,
        "productive_s": productive,
        "ettr": productive / wall,
        "kills": len(kills),
        "kill_offsets_s": [float(k["t"]) - t0 for k in kills],
        "attempts": len(firsts),
        "lost_steps": lost_steps,
        "lost_s": lost_steps * step_s,
        "checkpoint_s": checkpoint,
        "down_s": wall - productive - lost_steps * step_s - checkpoint,
        "step_s": step_s,
        "blocking_s": blocking_s,
        "write_s": write_s,
        # means, not medians: the simulator should reproduce the total time spent restarting
        "restore_s": statistics.fmean(restores) if restores else 0.0,
        "restart_s": statistics.fmean(restarts) if restarts else 0.0,
        "restart_samples_s": restarts,
    }


def write_run_report(run: Path, m: dict[str, Any], every: int, mttf: float) -> Path:
    """The measured costs in the ``simulate --from-run`` schema."""
    report = {
        "step_seconds": m["step_s"],
        "gpus": WORLD_SIZE,
        "gpus_per_node": 1,
        "tiers": {
            "local": {
                "every_n_steps": every,
                "blocking_seconds": m["blocking_s"],
                "write_seconds": m["write_s"],
                "restore_seconds": m["restore_s"],
                "durability": "host",
                "keep": 2,
            }
        },
        "restart_seconds": {"in_job": m["restart_s"]},
        "detection_seconds": {"crash": 0.0},
        # the scheduled failure rate, not the handful observed: the prediction is for that rate
        "failures": {"count": 1, "wall_seconds": mttf},
    }
    path = run / "resilience_report.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def predict(
    costs_run: Path, steps: int, every: int, kill_offsets: list[float], replications: int, measured: float
) -> dict[str, Any]:
    """The simulator with the costs measured in ``costs_run``: replaying ``kill_offsets`` and over Poisson draws; where
    ``measured`` (an ETTR) falls among the draws."""
    import dataclasses

    import numpy as np

    from lightning_resilience.sim import FailureTrace, apply_run_costs, load_run_costs, simulate, simulate_many
    from lightning_resilience.sim.config import FailureKindConfig, SimConfig

    costs = load_run_costs(costs_run)
    base = SimConfig()
    base = dataclasses.replace(
        base,
        cluster=dataclasses.replace(base.cluster, gpus=WORLD_SIZE, gpus_per_node=1),
        failures=dataclasses.replace(
            base.failures,
            mttf_s=float(costs.observed_mttf_s or 1.0),
            ref_gpus=WORLD_SIZE,
            kinds=[FailureKindConfig(name="crash", fraction=1.0, node_lost=False, restart="in_job")],
        ),
        job=dataclasses.replace(base.job, horizon_s=1e7, target_steps=steps - every),
    )
    cfg = apply_run_costs(base, costs)
    # the kills as they happened (the thread fires on schedule, so these are the drawn times up to the run's end)
    trace = FailureTrace.of([(t, "crash", 1) for t in kill_offsets])
    replay = simulate(cfg, trace=trace)
    mc = simulate_many(cfg, replications)
    return {
        "measured_percentile": float(100 * np.mean(mc.ettrs < measured) + 50 * np.mean(mc.ettrs == measured)),
        "config": dataclasses.asdict(cfg),
        "replay": replay.report(),
        "replay_ettr": replay.ettr,
        "poisson_ettr_mean": mc.ettr_mean,
        "poisson_ettr_stderr": mc.ettr_stderr,
        "poisson_ettr_p10_p90": [float(np.percentile(mc.ettrs, 10)), float(np.percentile(mc.ettrs, 90))],
        "poisson_failures_mean": mc.report()["failures_mean"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer steps and a shorter MTTF (about two minutes)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps to finish (600; quick: 250)")
    parser.add_argument("--every", type=int, default=10, help="LocalTier cadence in steps")
    parser.add_argument("--mttf", type=float, default=None, help="mean seconds between kills (60)")
    parser.add_argument("--max-kills", type=int, default=None, help="cap on kills (default: as drawn)")
    parser.add_argument("--seed", type=int, default=3, help="seed of the calibration run's kill times")
    parser.add_argument("--validation-seed", type=int, default=11, help="seed of the validation run's kill times")
    parser.add_argument(
        "--train-seed", type=int, default=7, help="training seed of the calibration run (+1: validation)"
    )
    parser.add_argument(
        "--kill-at", default=None, help="comma-separated kill times (s after the clock starts) instead of drawn ones"
    )
    parser.add_argument("--replications", type=int, default=400, help="Poisson draws for the prediction")
    parser.add_argument("--run-dir", default=None, help="working directory (default: a temporary one, removed)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="results JSON")
    parser.add_argument("--timeout", type=float, default=900.0, help="limit on the torchrun job (s)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    import numpy as np

    from benchmarks._common import command_line, machine_info, now_iso, print_flush, target, write_json

    steps = args.steps or (250 if args.quick else 600)
    mttf = args.mttf or 60.0

    def schedule(seed: int) -> list[float]:
        if args.kill_at:
            try:
                offsets = sorted(float(x) for x in args.kill_at.split(",") if x.strip())
            except ValueError:
                parser.error(f"--kill-at must be comma-separated seconds, got {args.kill_at!r}")
        else:
            drawn = np.cumsum(np.random.default_rng(seed).exponential(mttf, size=200))
            offsets = drawn[drawn < 3600.0].tolist()
        return offsets[: args.max_kills]

    if args.validation_seed == args.seed:
        parser.error("--validation-seed must differ from --seed: the validation run needs its own kill schedule")
    tmp = None
    if args.run_dir is None:
        tmp = tempfile.mkdtemp(prefix="sim_validation_")
        root = Path(tmp)
    else:
        root = Path(args.run_dir)
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    started = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    plan = {
        "calibration_run": (args.seed, args.train_seed),
        "validation_run": (args.validation_seed, args.train_seed + 1),
    }
    try:
        for name, (seed, train_seed) in plan.items():
            run = root / name
            run.mkdir(parents=True)
            offsets = schedule(seed)
            (run / "kills.json").write_text(json.dumps({"mttf_s": mttf, "seed": seed, "offsets_s": offsets}))
            print_flush(
                f"{name}: training {steps} steps on {WORLD_SIZE} ranks (seed {train_seed}), LocalTier every "
                f"{args.every}, kills every ~{mttf:g} s (schedule seed {seed})"
            )
            _launch(run, steps, args.every, restarts=len(offsets) + 3, timeout=args.timeout, train_seed=train_seed)
            m = measure(run, steps, args.every)
            write_run_report(run, m, args.every, mttf)
            runs[name] = {**m, "kill_schedule_seed": seed, "train_seed": train_seed, "scheduled_kills": len(offsets)}
        a, b = runs["calibration_run"], runs["validation_run"]
        calib = root / "calibration_run"
        predicted = predict(calib, steps, args.every, b["kill_offsets_s"], args.replications, b["ettr"])
        in_sample = predict(calib, steps, args.every, a["kill_offsets_s"], args.replications, a["ettr"])
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    b = runs["validation_run"]
    gap_poisson = 100 * (predicted["poisson_ettr_mean"] - b["ettr"])
    gap_replay = 100 * (predicted["replay_ettr"] - b["ettr"])
    targets = [
        target("validation run: ETTR gap, Poisson prediction from the calibration run (points)", abs(gap_poisson),
               "<=", TARGET_GAP_POINTS),
        target("validation run: ETTR gap, its kills replayed with the calibration costs (points)", abs(gap_replay),
               "<=", TARGET_GAP_POINTS),
        # one real run is one draw: it should fall inside the simulated spread, not on its mean (a 95% band)
        target("percentile of the validation ETTR among simulated runs", predicted["measured_percentile"], ">=", 2.5),
        target("percentile of the validation ETTR among simulated runs", predicted["measured_percentile"], "<=", 97.5),
    ]  # fmt: skip
    write_json(
        args.out,
        {
            "benchmark": "sim_validation",
            "command": command_line(MODULE, list(argv) if argv is not None else sys.argv[1:]),
            "date": now_iso(),
            "machine": machine_info(),
            "config": {
                "steps": steps,
                "every": args.every,
                "mttf_s": mttf,
                "world_size": 2,
                "quick": args.quick,
                "replications": args.replications,
            },
            "calibration_run": runs["calibration_run"],
            "validation_run": b,
            "predicted": predicted,
            "in_sample": {
                "replay_ettr": in_sample["replay_ettr"],
                "poisson_ettr_mean": in_sample["poisson_ettr_mean"],
                "gap_points_replay": 100 * (in_sample["replay_ettr"] - runs["calibration_run"]["ettr"]),
            },
            "gap_points": {"replay": gap_replay, "poisson_mean": gap_poisson},
            "targets": targets,
            "elapsed_s": time.perf_counter() - started,
        },
    )
    print_flush(render_markdown(json.loads(Path(args.out).read_text())))
    print_flush(f"results: {args.out}")
    return 0


def render_markdown(result: dict[str, Any]) -> str:
    """The comparison as Markdown (printed by :func:`main`, and the section of docs/benchmarks.md)."""
    from benchmarks._common import md_table

    a, b, p, cfg = result["calibration_run"], result["validation_run"], result["predicted"], result["config"]
    gap_replay, gap_poisson = result["gap_points"]["replay"], result["gap_points"]["poisson_mean"]
    rb = p["replay"]["breakdown_s"]

    def measured(name: str, m: dict[str, Any]) -> tuple[Any, ...]:
        return (name, f"{m['wall_s']:.1f} s", f"{100 * m['ettr']:.1f}%", f"{m['lost_s']:.1f} s", f"{m['down_s']:.1f} s",
                f"{m['checkpoint_s']:.2f} s", m["kills"])  # fmt: skip

    table = md_table(
        ["", "wall", "ETTR", "lost", "down (detect+restart+restore)", "checkpoint", "failures"],
        [
            measured("calibration run A (measured; gives the costs)", a),
            measured("**validation run B (measured)**", b),
            (
                f"B predicted from A's costs: Poisson mean of {cfg['replications']}",
                "",
                f"{100 * p['poisson_ettr_mean']:.1f}% "
                f"(p10-p90 {100 * p['poisson_ettr_p10_p90'][0]:.0f}-{100 * p['poisson_ettr_p10_p90'][1]:.0f}%)",
                "", "", "", f"{p['poisson_failures_mean']:.1f}",
            ),
            (
                "B predicted from A's costs, B's kill times replayed",
                f"{p['replay']['wall_s']:.1f} s",
                f"{100 * p['replay_ettr']:.1f}%",
                f"{rb['lost']:.1f} s",
                f"{rb['detection'] + rb['restart'] + rb['restore']:.1f} s",
                f"{rb['checkpoint']:.2f} s",
                sum(p["replay"]["failures"].values()),
            ),
        ],
    )  # fmt: skip
    ins = result["in_sample"]
    return "\n".join(
        [
            f"## {TITLE}",
            "",
            f"`{result['command']}` ({result['date']}): two independent runs of {cfg['steps']} steps on "
            f"{cfg['world_size']} CPU ranks under torchrun, LocalTier every {cfg['every']} steps, SIGKILLs every "
            f"~{cfg['mttf_s']:g} s: run A (training seed {a['train_seed']}, kill schedule seed "
            f"{a['kill_schedule_seed']}) calibrates the simulator, run B (seed {b['train_seed']}, schedule "
            f"{b['kill_schedule_seed']}) validates it. Nothing measured on B enters the prediction except, in the "
            "last row, its kill times.",
            "",
            table,
            "",
            f"costs measured on A: step {a['step_s'] * 1e3:.1f} ms, checkpoint blocking "
            f"{a['blocking_s'] * 1e3:.1f} ms, "
            f"write {a['write_s'] * 1e3:.1f} ms, restore {a['restore_s'] * 1e3:.1f} ms, restart {a['restart_s']:.2f} s "
            f"(B measured: step {b['step_s'] * 1e3:.1f} ms, restart {b['restart_s']:.2f} s)",
            "",
            f"ETTR gap on B: Poisson prediction {gap_poisson:+.2f} points, B's kills replayed {gap_replay:+.2f} points "
            f"(target: within {TARGET_GAP_POINTS:g}); B at the {p['measured_percentile']:.0f}th percentile of "
            f"{cfg['replications']} simulated runs (one run is one draw: target within the 95% band). In sample (A "
            f"predicted from its own costs and kills): {ins['gap_points_replay']:+.2f} points.",
            "",
            md_table(
                ["target", "value", "goal", "verdict"],
                [
                    (t["name"], f"{t['value']:.3g}", f"{t['op']} {t['threshold']:g}", t["verdict"])
                    for t in result["targets"]
                ],
            ),
            "",
        ]
    )


def readme_summary(result: dict[str, Any]) -> str:
    b, p = result["validation_run"], result["predicted"]
    return (
        f"**simulator**: calibrated on one fault-injected run and validated on another (other seed, other kill "
        f"schedule), it predicts the second run's ETTR ({100 * b['ettr']:.1f}%) within "
        f"{abs(result['gap_points']['poisson_mean']):.1f} points from the failure rate alone "
        f"({abs(result['gap_points']['replay']):.1f} with its kill times); the run falls at the "
        f"{p['measured_percentile']:.0f}th percentile of the simulated spread."
    )


if __name__ == "__main__":
    sys.exit(main())
