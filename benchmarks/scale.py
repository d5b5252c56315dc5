"""Scale: what the suite costs an ordinary step from 2 to 32 ranks on loopback, and a latency model for 1k to 16k.

Run from the repository root, alone on the machine::

    python -m benchmarks.scale              # N = 2, 4, 8, 16, 32 (about 25 minutes on 2 cores)
    python -m benchmarks.scale --quick      # smoke: N = 2, 4, few steps

For each N, one launch (``torchrun --standalone --nproc-per-node N -m benchmarks._scale_job``): a trivial model
(``Linear(8, 1)``) under Lightning DDP on gloo, with fits without the suite and with the default preset
(``+resilience=default``) interleaved in the same processes. Per ordinary step (after 5 warm-up steps, before the
last), on every rank:

* **the suite's time on the training thread**: the time inside the suite's callbacks' hooks plus the step driver's
  own (its round's issue at the batch start, then finish, agree, act, snapshot, stop, bookkeeping): what the suite
  itself costs the step, whatever the rest of the machine does;
* a **reference**: the CPU time of a fixed piece of host work of the suite's kind (Python calls, small containers,
  tiny tensor ops), run on the training thread at every batch start of the same fits. With N processes on 2 cores
  the same code takes more CPU time as N grows (cache and scheduler work charged to the thread); the suite's CPU
  time in units of the reference divides that out, and grows only if the suite's own work does;
* the step period with and without the suite (what the user feels; on 2 cores with N processes it is mostly the
  machine's scheduling, not the code);
* file descriptors per rank at mid-fit without and with the suite, and the time from fit start to the first batch.

Then, off Lightning, the latency of the step agreement (16 fields) and of gathers to rank 0 (256 B and 16 KiB per
rank). The **latency model**: a round is ``2 * depth(N)`` hops of a 4-ary tree, each ``alpha``; a gather to rank 0
is ``depth(N)`` hops plus ``beta`` per byte arriving at rank 0. ``alpha`` and ``beta`` are fitted here, where a hop
is a context switch of an oversubscribed CPU; the predictions at 1k, 4k and 16k ranks are given with that ``alpha``
and with a cluster's (``--alpha-cluster-us``, 20 us: a network round trip), stated as an assumption. The suite's
cost per step at scale is its measured fixed cost plus any wait for a round that outlasts the step. Off the ordinary
step, the side group's reductions of a few integers at the cadence steps (SDC's reconciliation and replay rounds) are
measured along the ranks' tree and through gloo's ring all-reduce, taking turns, and modelled both ways at scale.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import (
    REPO_ROOT,
    RESULTS_DIR,
    add_load_argument,
    check_load_at_start,
    command_line,
    cpu_counters,
    finish_load,
    load_line,
    machine_info,
    md_table,
    now_iso,
    print_flush,
    write_json,
)
from benchmarks._scale_model import PREDICT_AT, SDC, STEP_TIMES_S, assess, depth

TITLE = "Scale: the step path from 2 to 32 ranks, and a model for 1k to 16k ranks"
DEFAULT_OUT = RESULTS_DIR / "scale.json"
README_PENDING = (
    "**scale** (the suite's cost per ordinary step against the number of ranks): no result yet "
    "(`python -m benchmarks.scale` on a quiet machine)."
)
WARMUP = 5


def _launch(n: int, out: Path, steps: int, turns: int, rounds: int, timeout_s: float) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
        "-m", "benchmarks._scale_job", "--out", str(out), "--steps", str(steps), "--turns", str(turns),
        "--rounds", str(rounds),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        kept = Path(tempfile.gettempdir()) / f"scale_{n}_ranks_stderr.txt"
        kept.write_text(proc.stderr)
        raise RuntimeError(f"scale job with {n} ranks failed (its whole stderr: {kept}): {proc.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def _ordinary(by_step: dict[str, float], steps: int) -> list[float]:
    return [v for k, v in by_step.items() if WARMUP <= int(k) < steps - 1]


def _pct(xs: Sequence[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize_n(n: int, ranks: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """One N: the suite's own time per ordinary step, the step periods, descriptors, set-up, round latencies."""
    suite_ms: list[float] = []
    cpu_ms: list[float] = []
    preempted: list[float] = []
    reference_ms: list[float] = []
    rank0_ms: list[float] = []
    periods: dict[bool, list[float]] = {False: [], True: []}
    fds: dict[bool, list[int]] = {False: [], True: []}
    first: dict[bool, list[float]] = {False: [], True: []}
    late = rounds = 0
    calls = [c for res in ranks for c in _ordinary(res["calls_by_step"], steps)]
    for res in ranks:
        seen: set[bool] = set()
        for fit in res["fits"]:
            suite = bool(fit["suite"])
            periods[suite] += fit["periods_s"][WARMUP : steps - 1]
            if suite not in seen:  # the first fit of each kind: later ones keep the earlier fits' groups open
                fds[suite].append(int(fit["fds"]))
                seen.add(suite)
            if fit["first_batch_s"] is not None:
                first[suite].append(float(fit["first_batch_s"]))
            if suite:
                per_step = [1e3 * v for v in _ordinary(fit["suite_s_by_step"], steps)]
                suite_ms += per_step
                cpu_ms += [1e3 * v for v in _ordinary(fit["suite_cpu_s_by_step"], steps)]
                preempted += _ordinary(fit.get("suite_preempted_by_step", {}), steps)
                reference_ms += [1e3 * v for v in _ordinary(fit.get("reference_cpu_s_by_step", {}), steps)]
                if res["rank"] == 0:
                    rank0_ms += per_step
                late += int(fit["agreement"]["late"])
                rounds += int(fit["agreement"]["rounds"])
    mean = {k: statistics.fmean(v) for k, v in periods.items()}
    reduce_s = [x for res in ranks for x in res["reduce_s"]]
    return {
        "ranks": n,
        "depth": depth(n),
        "suite_ms": {
            "mean": statistics.fmean(suite_ms),
            "median": statistics.median(suite_ms),
            "p99": _pct(suite_ms, 99),
            "n": len(suite_ms),
        },
        "suite_cpu_ms": {
            "mean": statistics.fmean(cpu_ms),
            "median": statistics.median(cpu_ms),
            "p99": _pct(cpu_ms, 99),
        },
        "suite_calls": {"median": statistics.median(calls), "mean": statistics.fmean(calls), "max": max(calls)},
        **({"suite_preempted": {"mean": statistics.fmean(preempted)}} if preempted else {}),
        **(_in_reference_units(cpu_ms, reference_ms) if reference_ms else {}),
        "rank0_suite_ms_mean": statistics.fmean(rank0_ms) if rank0_ms else None,
        "period_ms": {
            "without": {"mean": 1e3 * mean[False], "p99": 1e3 * _pct(periods[False], 99)},
            "with": {"mean": 1e3 * mean[True], "p99": 1e3 * _pct(periods[True], 99)},
            "slowdown_mean": mean[True] / mean[False] - 1,
        },
        "fds_per_rank": {
            "without": max(fds[False]),
            "with": max(fds[True]),
            "added": max(w - b for w, b in zip(fds[True], fds[False])),
        },
        "first_batch_s": {"without": statistics.median(first[False]), "with": statistics.median(first[True])},
        "late_rounds": late,
        "rounds": rounds,
        "round_ms": {"median": 1e3 * statistics.median(reduce_s), "p99": 1e3 * _pct(reduce_s, 99)},
        "gather_ms": {
            "small": 1e3 * statistics.median(ranks[0]["gather_small_s"]),
            "large": 1e3 * statistics.median(ranks[0]["gather_large_s"]),
        },
        "side_reduce_ms": {
            way: 1e3 * statistics.median([x for res in ranks for x in res["side_reduce_s"][way]])
            for way in ("tree", "ring")
        },
    }


def _in_reference_units(cpu_ms: list[float], reference_ms: list[float]) -> dict[str, Any]:
    """The suite's CPU time per step over the reference work's, both on the training thread of the same fits: the
    contention of N processes on the cores divided out (what is left grows only if the suite's work does)."""
    ref = {"median": statistics.median(reference_ms), "mean": statistics.fmean(reference_ms)}
    return {
        "reference_cpu_ms": ref,
        "suite_cpu_in_reference": {
            "median": statistics.median(cpu_ms) / ref["median"],
            "mean": statistics.fmean(cpu_ms) / ref["mean"],
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="N of each launch (2 4 8 16 32)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--alpha-cluster-us", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="smoke: N = 2, 4 and few steps")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--from", dest="source", help="re-assess a saved run's rows (the model and the targets)")
    add_load_argument(parser)
    args = parser.parse_args(argv)
    if args.source:
        result = assess(json.loads(Path(args.source).read_text()), args.alpha_cluster_us * 1e-6)
        write_json(args.out, result)
        print_flush(render_markdown(result))
        return 0
    if args.quick:
        args.ranks, args.steps, args.turns, args.rounds = args.ranks or [2, 4], 20, 2, 5
    args.ranks = args.ranks or [2, 4, 8, 16, 32]
    machine = machine_info()
    check_load_at_start(machine, allow=args.allow_loaded, quick=args.quick, name="benchmarks.scale")
    since = cpu_counters()  # the N ranks load the machine themselves: the end is judged by others' CPU time
    rows = []
    for n in args.ranks:
        with tempfile.TemporaryDirectory(prefix=f"scale{n}_") as tmp:
            print_flush(f"[scale] {n} ranks")
            ranks = _launch(n, Path(tmp), args.steps, args.turns, args.rounds, timeout_s=300 + 30 * n)
        row = summarize_n(n, ranks, args.steps)
        rows.append(row)
        print_flush(
            f"[scale] {n:>3} ranks: suite {row['suite_ms']['mean']:.2f} ms/step (p99 {row['suite_ms']['p99']:.2f}; "
            f"CPU {row['suite_cpu_ms']['mean']:.2f}), "
            f"period +{100 * row['period_ms']['slowdown_mean']:.0f}%, fds +{row['fds_per_rank']['added']}, "
            f"round {row['round_ms']['median']:.2f} ms"
        )
    result: dict[str, Any] = {
        "benchmark": "scale",
        "title": TITLE,
        "when": now_iso(),
        "command": command_line("benchmarks.scale", list(argv or [])),
        "machine": finish_load(machine, since),
        "quick": args.quick,
        "steps": args.steps,
        "rows": rows,
    }
    assess(result, args.alpha_cluster_us * 1e-6)
    write_json(args.out, result)
    print_flush(render_markdown(result))
    return 0


def render_markdown(r: dict[str, Any], *, heading: str = "##") -> str:
    lines = [f"{heading} {TITLE}", ""]
    lines.append(
        f"`{r['command']}` on {r['machine'].get('cpu_count')} CPU cores, {r['when']} ({load_line(r['machine'])}); "
        "ranks on loopback (DDP over gloo, the step agreement over the suite's TCP links), a trivial model under "
        "Lightning DDP, the default preset against no suite in the same processes. CPU only: with N processes on 2 "
        "cores, a hop between ranks is a context switch."
    )
    lines.append("")
    rows = [
        [
            row["ranks"],
            f"{row['suite_ms']['mean']:.2f}",
            f"{row['suite_ms']['p99']:.2f}",
            f"{row['suite_cpu_ms']['mean']:.2f}",
            _reference_cell(row),
            f"{row['suite_calls']['mean']:.0f} / {row['suite_calls']['max']}" if "suite_calls" in row else "-",
            f"{row['suite_preempted']['mean']:.1f}" if "suite_preempted" in row else "-",
            f"{row['period_ms']['without']['mean']:.1f}",
            f"{row['period_ms']['with']['mean']:.1f}",
            f"{100 * row['period_ms']['slowdown_mean']:+.0f}%",
            f"{row['fds_per_rank']['without']} / {row['fds_per_rank']['with']} (+{row['fds_per_rank']['added']})",
            f"{row['first_batch_s']['without']:.2f} / {row['first_batch_s']['with']:.2f}",
            f"{row['round_ms']['median']:.2f}",
            f"{row['late_rounds']}/{row['rounds']}",
        ]
        for row in r["rows"]
    ]
    lines.append(
        md_table(
            [
                "ranks",
                "suite ms/step (mean)",
                "suite p99",
                "suite CPU ms/step",
                "reference CPU ms (suite CPU in its units), median",
                "suite calls/step (mean / most)",
                "suite preempted/step (mean)",
                "step ms without",
                "step ms with",
                "slowdown",
                "fds/rank without / with",
                "fit start to 1st batch s",
                "round ms",
                "rounds late",
            ],
            rows,
        )
    )
    m = r["model"]
    lines += [
        "",
        "Suite time per ordinary step against N (least-squares slope per rank, and the line at 2 ranks): "
        + "; ".join(
            f"{label} {r['slopes'][k]['per_rank'] * 1e3:.1f} us per rank, {r['slopes'][k]['at_2']:.2f} ms at 2"
            for k, label in (("cpu_median", "CPU median"), ("cpu_mean", "CPU mean"), ("wall_mean", "wall mean"))
        )
        + (
            f"; calls per step: mean {r['slopes']['calls_mean']['per_rank']:.2f} per rank, "
            f"{r['slopes']['calls_mean']['at_2']:.0f} at 2"
            if "calls_mean" in r["slopes"]
            else ""
        )
        + (
            f"; CPU in units of the reference work (median): {r['slopes']['cpu_ref_median']['per_rank']:+.4f} per "
            f"rank, {r['slopes']['cpu_ref_median']['at_2']:.2f} at 2"
            if "cpu_ref_median" in r["slopes"]
            else ""
        )
        + ". The wall time holds the time the training thread is descheduled while N processes share the cores "
        "(N / 2 per core here) and any wait for a round that outlasts the step. The CPU time grows with N while the "
        "calls do not: the same work runs slower after each time the scheduler takes the thread's core away inside "
        "the suite's hooks (column *preempted*), on caches the other processes have filled. "
        f"Latency model: alpha {m['alpha_us_fitted']:.0f} us per hop fitted "
        f"here (a cluster's: {m['alpha_us_cluster']:.0f} us, assumed), beta {m['beta_ns_per_byte']:.2f} ns per byte at "
        f"rank 0, the suite's fixed cost {m['fixed_ms']:.2f} ms per step (measured above); a straggler exchange "
        f"of {m.get('straggler_record_b', 400)} B a rank.",
        "",
    ]
    pred = [
        [
            p["ranks"],
            p["alpha"],
            f"{p['round_ms']:.2f}",
            f"{p['straggler_gather_ms']:.1f}",
            *[f"{p['suite_ms_per_step'][str(t)]:.2f}" for t in STEP_TIMES_S],
        ]
        for p in m["predictions"]
    ]
    header = ["ranks", "alpha", "round ms", "straggler gather ms"]
    header += [f"suite ms/step, {t:g} s steps" for t in STEP_TIMES_S]
    lines.append(md_table(header, pred))
    lines.append("")
    if all("reduction_ms" in p for p in m["predictions"]):
        lines += _cadence_lines(m, r["rows"])
    for t in r["targets"]:
        value = t["value"]
        shown = "n/a" if value is None else f"{value:.3g}"
        lines.append(f"- {t['name']}: {shown} {t.get('unit', '')} ({t['verdict']})")
    return "\n".join(lines) + "\n"


def _cadence_lines(m: dict[str, Any], rows_measured: list[dict[str, Any]]) -> list[str]:
    """The model's side-group reductions at the cadence steps: along the tree, against gloo's ring all-reduce."""
    rows = [
        [
            p["ranks"],
            p["alpha"],
            f"{p['reduction_ms']['tree']:.2f}",
            f"{p['reduction_ms']['ring']:.1f}",
            f"{p['sdc_cadence_ms_per_step']['tree']:.3f}",
            f"{p['sdc_cadence_ms_per_step']['ring']:.2f}",
        ]
        for p in m["predictions"]
    ]
    header = ["ranks", "alpha", "reduction ms, tree", "gloo ring all-reduce ms", "SDC cadences ms/step, tree", "ring"]
    measured = [r for r in rows_measured if "side_reduce_ms" in r]
    here = (
        " Measured here, taking turns (median over every rank's reductions): "
        + "; ".join(
            f"{r['ranks']} ranks {r['side_reduce_ms']['tree']:.2f} ms along the tree, "
            f"{r['side_reduce_ms']['ring']:.2f} ms through the ring"
            for r in measured
        )
        + ". On 2 cores a hop is a context switch and every rank must be scheduled whatever the algorithm: the chain "
        "of hops, which the model counts, is what sets them apart at scale."
        if measured
        else ""
    )
    return [
        "Off the ordinary step, the training thread waits for the side group's reductions of a few integers at the "
        "steps a cadence names: at the default preset's SDC cadences, a reconciliation's hash every "
        f"{SDC.reconcile_every_n_steps} steps and a scheduled replay round's two flags every "
        f"{SDC.replay_every_n_steps} ({m['sdc_reductions_per_step']:.3f} reductions a "
        "step). They ride the step agreement's 4-ary tree, on its thread and links (`TreeAgreement.reduce_now`): "
        "2 depth(N) hops, where gloo's all-reduce, which they used before, is a ring of 2 (N - 1) hops one after "
        f"another.{here} The model, with the round's own cost as above:",
        "",
        md_table(header, rows),
        "",
    ]


def _reference_cell(row: dict[str, Any]) -> str:
    if "reference_cpu_ms" not in row:
        return "-"
    return f"{row['reference_cpu_ms']['median']:.3f} ({row['suite_cpu_in_reference']['median']:.1f}x)"


def readme_summary(r: dict[str, Any]) -> str:
    rows = r["rows"]
    first, last = rows[0], rows[-1]
    m = r["model"]
    at16k = next((p for p in m["predictions"] if p["ranks"] == PREDICT_AT[-1] and p["alpha"] == "cluster"), None)
    tail = (
        f"; modelled at {at16k['ranks']:,} ranks (20 us hops): a round of {at16k['round_ms']:.2f} ms, hidden by any "
        "step longer than that"
        if at16k
        else ""
    )
    return (
        f"**scale** (ranks on loopback, trivial model, default preset, CPU): the suite's own time per ordinary "
        f"step is {first['suite_ms']['mean']:.2f} ms at {first['ranks']} ranks and {last['suite_ms']['mean']:.2f} ms "
        f"at {last['ranks']} (CPU time {first['suite_cpu_ms']['mean']:.2f} and {last['suite_cpu_ms']['mean']:.2f} "
        f"ms, its median's slope {r['slopes']['cpu_median']['per_rank'] * 1e3:.1f} us per rank); it adds "
        f"{max(x['fds_per_rank']['added'] for x in rows)} file descriptors per rank at most{tail}."
    )


if __name__ == "__main__":
    raise SystemExit(main())
