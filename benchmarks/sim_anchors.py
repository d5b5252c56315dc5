"""How close does the reliability simulator come to published figures, and how fast is it?

Run from the repository root::

    python -m benchmarks.sim_anchors            # about a minute
    python -m benchmarks.sim_anchors --quick    # fewer replications, seconds

Anchors (see docs/simulator.md for the assumptions behind each):

* Kokolis et al. (HPCA'25): job MTTF 7.9 h at 1,024 GPUs, 47.7 days at 8 GPUs (measured), 1.8 h at 16k and 14 min
  at 131k GPUs (projected); "ETTR ~0.9 at 12k GPUs needs ~1 failure per 1,000 node-days (not 6.5) or O(10 s)
  checkpoint writes".
* ByteRobust (SOSP'25): 97% ETTR over 3 months on 9,600 GPUs (every-step checkpoints to a peer, 0.01-0.04 s
  blocking, detection in 2-30 s, hot update 46-65 s, warm standbys).
* TrainMover (OSDI'26): cold restart 6.47 min at 8,192 GPUs (35.1% of the 4.45 min framework init is checkpoint
  load); < 30 s with a standby after a failure.
* Daly (2006): the optimum interval, and the ETTR of his complete model, for exponential failures.

And the simulator's own speed on a 90-day, 10,000-GPU job (median of repeated runs on this machine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks._common import command_line, machine_info, md_table, now_iso, print_flush, target, write_json
from lightning_resilience.sim import (
    daly_ettr,
    daly_interval,
    draw_failures,
    optimal_interval,
    simulate,
    simulate_many,
    young_interval,
)
from lightning_resilience.sim.config import (
    ClusterConfig,
    FailureConfig,
    FailureKindConfig,
    JobConfig,
    RestartConfig,
    SimConfig,
    SimTierConfig,
)

MODULE = "benchmarks.sim_anchors"
DEFAULT_OUT = "benchmarks/results/sim_anchors.json"
TITLE = "Simulator against published anchors (Kokolis, ByteRobust, TrainMover, Daly) and its speed"
HOUR, DAY = 3600.0, 86400.0


def _mttf_anchor(replications: int) -> dict[str, Any]:
    """Failure counts drawn by the simulator against the Kokolis MTTFs (1/N scaling from 7.9 h at 1,024)."""
    rows = []
    for gpus, published, label, ref in (
        (8, 47.7 * DAY, "measured", (7.9 * HOUR, 1024)),
        (1024, 7.9 * HOUR, "measured (the reference)", (7.9 * HOUR, 1024)),
        (16384, 1.8 * HOUR, "projected", (7.9 * HOUR, 1024)),
        (131072, 14 * 60.0, "projected", (1.8 * HOUR, 16384)),
    ):
        cfg = SimConfig(
            cluster=ClusterConfig(gpus=gpus, gpus_per_node=min(8, gpus)),
            failures=FailureConfig(mttf_s=ref[0], ref_gpus=ref[1]),
            job=JobConfig(horizon_s=2000 * ref[0] * ref[1] / gpus),  # ~2000 failures expected
        )
        counts = [len(draw_failures(cfg, np.random.default_rng(s))) for s in range(replications)]
        simulated = cfg.job.horizon_s / statistics.fmean(counts)
        rows.append(
            {
                "gpus": gpus,
                "reference": f"{ref[0] / HOUR:g} h @ {ref[1]}",
                "published_mttf_s": published,
                "published_kind": label,
                "simulated_mttf_s": simulated,
                "gap": simulated / published - 1,
            }
        )
    return {"rows": rows}


def _kokolis_ettr(replications: int) -> dict[str, Any]:
    """ETTR at 12k GPUs for 6.5 vs 1 failures per 1,000 node-days and 300 s vs 10 s checkpoints (Daly interval)."""
    rows = []
    for rate in (6.5, 1.0):
        for delta in (300.0, 10.0):
            node_mttf = 1000.0 / rate * DAY
            cfg = SimConfig(
                cluster=ClusterConfig(gpus=12288, gpus_per_node=8),
                failures=FailureConfig(
                    mttf_s=node_mttf,
                    ref_gpus=8,
                    kinds=[FailureKindConfig(name="crash", fraction=1.0, detection_s=0.0, restart="in_job")],
                ),
                restart=RestartConfig(in_job=300.0),
                job=JobConfig(step_s=5.0, horizon_s=60 * DAY),
                tiers=[SimTierConfig(name="ckpt", every_s=1.0, blocking_s=delta)],
            )
            mttf = cfg.failures.job_mttf_s(12288)
            interval = daly_interval(delta, mttf)
            cfg.tiers[0].every_s = interval
            mc = simulate_many(cfg, replications)
            rows.append(
                {
                    "failures_per_1000_node_days": rate,
                    "checkpoint_s": delta,
                    "job_mttf_s": mttf,
                    "interval_s": interval,
                    "ettr": mc.ettr_mean,
                    "ettr_stderr": mc.ettr_stderr,
                    "daly_model_ettr": daly_ettr(interval, delta, mttf, 300.0),
                }
            )
    return {"assumptions": "12,288 GPUs in 8-GPU nodes, restart 5 min, crash-only, Daly interval", "rows": rows}


def _byterobust(replications: int) -> dict[str, Any]:
    """9,600 GPUs with ByteRobust's recovery machinery and the Kokolis failure rate."""
    kinds = [
        FailureKindConfig(name="crash", fraction=0.636, detection_s=16.0, node_lost=True),
        FailureKindConfig(name="hang", fraction=0.2, detection_s=30.0, restart="in_job"),
        FailureKindConfig(name="fail_slow", fraction=0.15, detection_s=30.0, node_lost=True, slowdown=0.3),
        FailureKindConfig(name="sdc", fraction=0.014, detection_s=600.0, node_lost=True),
    ]

    def config(mttf_at_1024: float) -> SimConfig:
        return SimConfig(
            cluster=ClusterConfig(gpus=9600, gpus_per_node=16, spare_nodes=8, spare_refill_s=4 * HOUR),
            failures=FailureConfig(mttf_s=mttf_at_1024, ref_gpus=1024, kinds=kinds),
            tiers=[
                SimTierConfig(
                    name="peer", every_n_steps=1, blocking_s=0.025, write_s=5.0, restore_s=10.0, durability="peer"
                ),
                SimTierConfig(name="remote", every_s=3600.0, blocking_s=0.0, write_s=600.0, restore_s=120.0, keep=3),
            ],
            restart=RestartConfig(in_job=56.0, warm_spare=56.0, cold=611.0),
            job=JobConfig(step_s=10.0, horizon_s=90 * DAY),
        )

    mc = simulate_many(config(7.9 * HOUR), replications)
    # the failure rate at which this setup reaches the published 97% (bisection on the MTTF at 1,024 GPUs)
    lo, hi = 1.0 * HOUR, 200.0 * HOUR
    for _ in range(10):
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if simulate_many(config(mid), 2).ettr_mean >= 0.97 else (mid, hi)
    return {
        "assumptions": (
            "9,600 GPUs (600 nodes x 16), job MTTF 50.6 min (7.9 h @ 1,024), step 10 s, every-step peer checkpoint "
            "blocking 25 ms (committed 5 s later), hourly remote; crash 63.6% detected in 16 s, hang 20% and fail-slow "
            "15% in 30 s, SDC 1.4% (Llama 3: 6 of 419) in 10 min; hot update / warm standby 56 s, 8 spares "
            "refilled in 4 h, requeue 611 s"
        ),
        "mttf_at_1024_for_97pct_s": hi,
        "job_mttf_for_97pct_s": hi * 1024 / 9600,
        "published_ettr": 0.97,
        "ettr": mc.ettr_mean,
        "ettr_stderr": mc.ettr_stderr,
        "gap_points": 100 * (mc.ettr_mean - 0.97),
        "breakdown_fraction": mc.breakdown_fractions(),
    }


def _trainmover(replications: int) -> dict[str, Any]:
    """Default cold path at 8,192 GPUs (294 s restart + 94 s remote restore = 6.47 min), and a standby instead."""
    crash = [FailureKindConfig(name="crash", fraction=1.0, detection_s=10.0, node_lost=True)]
    tiers = [SimTierConfig(name="remote", every_s=1800.0, blocking_s=2.0, write_s=300.0, restore_s=94.0)]
    out: dict[str, Any] = {}
    for label, spares, warm in (("cold", 0, 30.0), ("warm_spare", 16, 30.0)):
        cfg = SimConfig(
            cluster=ClusterConfig(gpus=8192, spare_nodes=spares, spare_refill_s=2 * HOUR),
            failures=FailureConfig(kinds=crash),
            tiers=tiers,
            restart=RestartConfig(warm_spare=warm),
            job=JobConfig(horizon_s=30 * DAY),
        )
        runs = simulate_many(cfg, replications).runs
        recoveries = sum(sum(r.restores.values()) for r in runs)
        down = sum(r.breakdown.restart + r.breakdown.restore for r in runs)
        out[label] = {
            "configured_s": cfg.restart.seconds(label) + tiers[0].restore_s,
            "downtime_per_recovery_s": down / recoveries,
            "ettr": float(np.mean([r.ettr for r in runs])),
        }
    out["published_cold_s"] = 6.47 * 60
    out["gap"] = out["cold"]["configured_s"] / out["published_cold_s"] - 1
    out["effective_gap"] = out["cold"]["downtime_per_recovery_s"] / out["published_cold_s"] - 1
    return out


def _daly(replications: int) -> dict[str, Any]:
    rows = []
    for delta, mttf, restart in ((60.0, HOUR, 300.0), (10.0, 2 * HOUR, 120.0), (600.0, HOUR, 300.0)):
        crash = [FailureKindConfig(name="crash", fraction=1.0, restart="in_job")]
        daly = daly_interval(delta, mttf)
        cfg = SimConfig(
            cluster=ClusterConfig(gpus=8, gpus_per_node=8),
            failures=FailureConfig(mttf_s=mttf, ref_gpus=8, kinds=crash),
            tiers=[SimTierConfig(name="ckpt", every_s=daly, blocking_s=delta)],
            restart=RestartConfig(in_job=restart),
            job=JobConfig(step_s=1.0, horizon_s=2000 * mttf),
        )
        opt, _rows = optimal_interval(
            cfg, candidates_s=list(daly * np.geomspace(0.4, 2.5, 11)), replications=replications
        )
        at_daly = simulate_many(cfg, replications)
        rows.append(
            {
                "delta_s": delta,
                "mttf_s": mttf,
                "restart_s": restart,
                "delta_over_mttf": delta / mttf,
                "young_s": young_interval(delta, mttf),
                "daly_s": daly,
                "simulated_optimum_s": opt,
                "optimum_gap": opt / daly - 1,
                "sim_ettr_at_daly": at_daly.ettr_mean,
                "daly_model_ettr": daly_ettr(cfg.tiers[0].interval_steps(1.0), delta, mttf, restart),
            }
        )
    return {"rows": rows}


def _speed(repeats: int) -> dict[str, Any]:
    cfg = SimConfig(cluster=ClusterConfig(gpus=10_000), job=JobConfig(horizon_s=90 * DAY))
    simulate(cfg)  # warm-up (imports, allocator)
    times, failures = [], []
    for seed in range(repeats):
        started = time.perf_counter()
        r = simulate(cfg, seed=seed)
        times.append(time.perf_counter() - started)
        failures.append(sum(r.failures.values()))
    return {
        "gpus": 10_000,
        "days": 90,
        "failures_mean": statistics.fmean(failures),
        "seconds_median": statistics.median(times),
        "seconds_max": max(times),
        "samples_s": times,
    }


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer replications (smoke mode)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="results JSON")
    args = parser.parse_args(list(argv) if argv is not None else None)
    reps = 2 if args.quick else 8
    started = time.perf_counter()

    mttf = _mttf_anchor(reps)
    kok = _kokolis_ettr(reps)
    br = _byterobust(reps)
    tm = _trainmover(reps)
    daly = _daly(reps)
    speed = _speed(3 if args.quick else 7)
    kokolis_ok = [r for r in kok["rows"] if r["ettr"] >= 0.88]
    targets = [
        target("MTTF at 1,024 GPUs (sim / 7.9 h - 1)", abs(mttf["rows"][1]["gap"]), "<=", 0.05),
        target(
            "Kokolis: ETTR >= 0.88 only with 1/1000 node-days or 10 s writes",
            float(
                len(kokolis_ok) == 3
                and all(not (r["failures_per_1000_node_days"] == 6.5 and r["checkpoint_s"] == 300) for r in kokolis_ok)
            ),
            ">=",
            1.0,
        ),
        target("ByteRobust ETTR gap (points)", abs(br["gap_points"]), "<=", 2.0),
        target("TrainMover cold downtime per recovery gap", abs(tm["effective_gap"]), "<=", 0.10),
        target("Daly optimum gap (delta/M <= 0.02)", max(abs(r["optimum_gap"]) for r in daly["rows"][:2]), "<=", 0.15),
        target(
            "ETTR vs Daly model at T* (points)",
            100 * max(abs(r["sim_ettr_at_daly"] - r["daly_model_ettr"]) for r in daly["rows"]),
            "<=",
            1.0,
        ),
        target("90-day 10,000-GPU simulation (s)", speed["seconds_median"], "<=", 5.0),
    ]
    result = {
        "benchmark": "sim_anchors",
        "command": command_line(MODULE, list(argv) if argv is not None else sys.argv[1:]),
        "date": now_iso(),
        "machine": machine_info(),
        "config": {"quick": args.quick, "replications": reps},
        "kokolis_mttf": mttf,
        "kokolis_ettr": kok,
        "byterobust": br,
        "trainmover": tm,
        "daly": daly,
        "speed": speed,
        "targets": targets,
        "elapsed_s": time.perf_counter() - started,
    }
    print_flush(render_markdown(result))
    write_json(args.out, result)
    print_flush(f"\nresults: {args.out}")
    return 0


def render_markdown(result: dict[str, Any]) -> str:
    """The anchors as Markdown (printed by :func:`main`, and the section of docs/benchmarks.md)."""
    mttf, kok, br = result["kokolis_mttf"], result["kokolis_ettr"], result["byterobust"]
    tm, daly, speed = result["trainmover"], result["daly"], result["speed"]
    out = [
        f"## {TITLE}",
        "",
        f"`{result['command']}` ({result['date']}), {result['config']['replications']} replications per figure.",
        "",
        "### Kokolis: job MTTF against scale (1/N scaling from a reference)",
        "",
        md_table(
            ["GPUs", "reference", "published", "simulated", "gap"],
            [
                (
                    r["gpus"],
                    r["reference"],
                    f"{r['published_mttf_s'] / HOUR:.2f} h ({r['published_kind']})",
                    f"{r['simulated_mttf_s'] / HOUR:.2f} h",
                    _pct(r["gap"]),
                )
                for r in mttf["rows"]
            ],
        ),
        "",
        f"### Kokolis: ETTR at 12k GPUs ({kok['assumptions']})",
        "",
        md_table(
            ["failures / 1000 node-days", "checkpoint", "job MTTF", "interval", "ETTR (sim)", "ETTR (Daly model)"],
            [
                (
                    r["failures_per_1000_node_days"],
                    f"{r['checkpoint_s']:g} s",
                    f"{r['job_mttf_s'] / HOUR:.2f} h",
                    f"{r['interval_s'] / 60:.1f} min",
                    f"{r['ettr']:.3f} ± {r['ettr_stderr']:.3f}",
                    f"{r['daly_model_ettr']:.3f}",
                )
                for r in kok["rows"]
            ],
        ),
        "",
        "### ByteRobust: 97% ETTR at 9,600 GPUs",
        "",
        br["assumptions"],
        "",
        f"simulated ETTR {_pct(br['ettr'])} ± {_pct(br['ettr_stderr'])}: {br['gap_points']:+.2f} points; this setup "
        f"reaches 97% once the MTTF at 1,024 GPUs is {br['mttf_at_1024_for_97pct_s'] / HOUR:.1f} h "
        f"(job MTTF {br['job_mttf_for_97pct_s'] / HOUR:.2f} h at 9,600 GPUs)",
        "",
        "### TrainMover: cold restart 6.47 min at 8,192 GPUs",
        "",
        f"cold path restart + restore: {tm['cold']['configured_s'] / 60:.2f} min (published 6.47 min, "
        f"{_pct(tm['gap'])}); downtime per completed recovery {tm['cold']['downtime_per_recovery_s'] / 60:.2f} min "
        f"({_pct(tm['effective_gap'])}: failures during a recovery restart it), warm spare "
        f"{tm['warm_spare']['downtime_per_recovery_s']:.0f} s; "
        f"ETTR cold {_pct(tm['cold']['ettr'])}, warm spare {_pct(tm['warm_spare']['ettr'])}",
        "",
        "### Daly: simulated optimum interval and ETTR against the formula",
        "",
        md_table(
            ["delta", "MTTF", "R", "delta/M", "Young", "Daly", "sim optimum", "gap", "sim ETTR @Daly", "Daly ETTR"],
            [
                (
                    f"{r['delta_s']:g} s",
                    f"{r['mttf_s'] / HOUR:g} h",
                    f"{r['restart_s']:g} s",
                    f"{r['delta_over_mttf']:.3f}",
                    f"{r['young_s']:.0f} s",
                    f"{r['daly_s']:.0f} s",
                    f"{r['simulated_optimum_s']:.0f} s",
                    _pct(r["optimum_gap"]),
                    f"{r['sim_ettr_at_daly']:.4f}",
                    f"{r['daly_model_ettr']:.4f}",
                )
                for r in daly["rows"]
            ],
        ),
        "",
        "### Speed",
        "",
        f"90-day 10,000-GPU job ({speed['failures_mean']:.0f} failures): median "
        f"{speed['seconds_median'] * 1e3:.0f} ms, max {speed['seconds_max'] * 1e3:.0f} ms per simulation",
        "",
        md_table(
            ["target", "value", "goal", "verdict"],
            [
                (t["name"], f"{t['value']:.4g}", f"{t['op']} {t['threshold']:g}", t["verdict"])
                for t in result["targets"]
            ],
        ),
        "",
    ]
    return "\n".join(out)


def readme_summary(result: dict[str, Any]) -> str:
    passed = sum(t["verdict"] == "PASS" for t in result["targets"])
    missed = [t["name"] for t in result["targets"] if t["verdict"] != "PASS"]
    return (
        f"**simulator anchors** (Kokolis, ByteRobust, TrainMover, Daly): {passed} of {len(result['targets'])} "
        "published figures reproduced"
        + (f" (missed: {'; '.join(missed)})" if missed else "")
        + f"; a 90-day 10,000-GPU job simulates in {result['speed']['seconds_median']:.2f} s."
    )


if __name__ == "__main__":
    sys.exit(main())
