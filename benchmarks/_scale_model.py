"""The model of ``benchmarks.scale``: the tree's depth, the alpha-beta fit of the measured rounds and its predictions
at 1k to 16k ranks, and the assessment of the measured rows against the goals."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks._common import target
from lightning_resilience.rank_tree import RankTree
from lightning_resilience.sdc.config import SDCConfig

__all__ = [
    "FANOUT", "PREDICT_AT", "SDC", "SDC_REDUCTIONS_PER_STEP", "STEP_TIMES_S", "assess", "depth", "model",
]  # fmt: skip

FANOUT = 4
PREDICT_AT = (1024, 4096, 16384)
STEP_TIMES_S = (0.1, 1.0)
FIELDS = 16
STRAGGLER_RECORD_B = 460
"""Bytes per rank of a straggler exchange: 10 steps of 7 sections, a binary head, a node's JSON text, int64 steps and
float32 timings (as ``benchmarks.exchange_rank0`` measures it; 730 B with float64 and a JSON head, and runs before
that assumed 400 B, where the JSON record was 2.2 KB)."""


SDC = SDCConfig()
SDC_REDUCTIONS_PER_STEP = 1 / SDC.reconcile_every_n_steps + 2 / SDC.replay_every_n_steps
"""Reductions of the suite's side group on the training thread per step at the default preset's SDC cadences: a
reconciliation (one reduction of its hash) every 50 steps and a scheduled replay round (two of a flag) every 200."""


def depth(n: int, fanout: int = FANOUT) -> int:
    """Levels below rank 0 of the ``fanout``-ary tree of ``n`` ranks."""
    return RankTree(0, n, fanout).depth


def _fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


def model(rows: list[dict[str, Any]], alpha_cluster_s: float) -> dict[str, Any]:
    """Fit alpha (per hop) and beta (per byte at rank 0), and predict at 1k, 4k and 16k ranks."""
    hops = [2 * r["depth"] for r in rows]
    c0, alpha = _fit_line(hops, [r["round_ms"]["median"] / 1e3 for r in rows])
    alpha, c0 = max(alpha, 1e-6), max(c0, 0.0)
    # a cluster's round: the software's own cost of a round (the round at the fewest ranks, where the hops are
    # loopback's and no core is shared, all counted as overhead: an upper bound) plus its hops at the cluster's alpha
    overhead_cluster = rows[0]["round_ms"]["median"] / 1e3
    # the 16 KiB gather against the 256 B one: the extra bytes all arrive at rank 0
    betas = [
        max(0.0, (r["gather_ms"]["large"] - r["gather_ms"]["small"]) / 1e3) / ((16384 - 256) * (r["ranks"] - 1))
        for r in rows
        if r["ranks"] > 1
    ]
    beta = statistics.median(betas) if betas else 0.0
    fixed_ms = rows[0]["suite_ms"]["mean"]  # the fewest ranks: no core shared by more than one rank
    predictions = []
    for n in PREDICT_AT:
        for name, a, c in (("fitted here", alpha, c0), ("cluster", alpha_cluster_s, overhead_cluster)):
            round_s = c + 2 * depth(n) * a + beta * 8 * FIELDS * FANOUT * depth(n)
            gather_s = depth(n) * a + beta * STRAGGLER_RECORD_B * n
            waits = {str(t): max(0.0, round_s - t) * 1e3 for t in STEP_TIMES_S}
            # a side-group reduction of a few integers, on the training thread at a cadence step: along the same
            # tree, or (before) gloo's ring all-reduce, 2 (N - 1) hops one after another
            tree_s, ring_s = c + 2 * depth(n) * a, c + 2 * (n - 1) * a
            predictions.append(
                {
                    "ranks": n,
                    "alpha": name,
                    "round_ms": round_s * 1e3,
                    "straggler_gather_ms": gather_s * 1e3,
                    "suite_ms_per_step": {str(t): fixed_ms + waits[str(t)] for t in STEP_TIMES_S},
                    "reduction_ms": {"tree": tree_s * 1e3, "ring": ring_s * 1e3},
                    "sdc_cadence_ms_per_step": {
                        "tree": tree_s * 1e3 * SDC_REDUCTIONS_PER_STEP,
                        "ring": ring_s * 1e3 * SDC_REDUCTIONS_PER_STEP,
                    },
                }
            )
    return {
        "alpha_us_fitted": alpha * 1e6,
        "round_intercept_ms": c0 * 1e3,
        "round_overhead_cluster_ms": overhead_cluster * 1e3,
        "beta_ns_per_byte": beta * 1e9,
        "straggler_record_b": STRAGGLER_RECORD_B,
        "alpha_us_cluster": alpha_cluster_s * 1e6,
        "fixed_ms": fixed_ms,
        "sdc_reductions_per_step": SDC_REDUCTIONS_PER_STEP,
        "predictions": predictions,
    }


def _slope(rows: list[dict[str, Any]], key: str, stat: str) -> tuple[float, float]:
    """Least-squares slope per rank of ``row[key][stat]`` over N, and the line's value at 2 ranks."""
    a, slope = _fit_line([r["ranks"] for r in rows], [r[key][stat] for r in rows])
    return slope, a + 2 * slope


def assess(result: dict[str, Any], alpha_cluster_s: float) -> dict[str, Any]:
    """The slopes, the latency model and the targets of a run's rows (``--from``: again, from a saved run).

    Whether the suite's work on the training thread grows with N is judged on what the load cannot move: the Python
    and C calls it makes per ordinary step (mean: the periodic work counts too). Its times are judged too, and
    shown: with N processes on 2 cores the wall time holds the time a rank is descheduled, and even the thread's CPU
    time grows with the contention (cache and scheduler work charged to the thread)."""
    rows = result["rows"]
    counted = all("suite_calls" in r for r in rows)
    slopes = {
        "cpu_median": _slope(rows, "suite_cpu_ms", "median"),
        "cpu_mean": _slope(rows, "suite_cpu_ms", "mean"),
        "wall_mean": _slope(rows, "suite_ms", "mean"),
    }
    if counted:
        slopes["calls_mean"] = _slope(rows, "suite_calls", "mean")
        slopes["calls_median"] = _slope(rows, "suite_calls", "median")
    referenced = all("suite_cpu_in_reference" in r for r in rows)
    if referenced:
        slopes["cpu_ref_median"] = _slope(rows, "suite_cpu_in_reference", "median")
        slopes["cpu_ref_mean"] = _slope(rows, "suite_cpu_in_reference", "mean")
    result["slopes"] = {k: {"per_rank": v[0], "at_2": v[1], "relative": v[0] / v[1]} for k, v in slopes.items()}
    result["model"] = model(rows, alpha_cluster_s)
    rel = result["slopes"]
    result["targets"] = [
        target(
            f"suite calls per ordinary step on the training thread, {stat}: slope per rank / value at 2 ranks",
            rel[f"calls_{stat}"]["relative"] if counted else None,
            "<=",
            0.01,
        )
        for stat in ("mean", "median")
    ] + [
        target(
            "suite CPU time per ordinary step, median: slope per rank / value at 2 ranks",
            rel["cpu_median"]["relative"],
            "<=",
            0.01,
        ),
        target(
            "suite CPU time per ordinary step, mean: slope per rank / value at 2 ranks",
            rel["cpu_mean"]["relative"],
            "<=",
            0.01,
        ),
    ]
    result["targets"] += [
        target(
            f"suite CPU time per ordinary step in units of a fixed reference work's (same thread, same fits), {stat}: "
            "slope per rank / value at 2 ranks",
            rel[f"cpu_ref_{stat}"]["relative"] if referenced else None,
            "<=",
            0.01,
        )
        for stat in ("median", "mean")
    ]
    result["targets"] += [
        target("suite time per ordinary step at 2 ranks (trivial model)", rows[0]["suite_ms"]["mean"], "<=", 5.0, "ms"),
        target(
            "file descriptors the suite adds per rank, less N (most over N; goal: at most N + 16)",
            max(r["fds_per_rank"]["added"] - r["ranks"] for r in rows),
            "<=",
            16,
        ),
    ]
    return result
