"""The scoring of ``benchmarks.straggler_detection``'s real trials: when a slow rank's slowness began, the step periods
after the warm-up, latency, recall and precision of the verdicts, and NVRx's rule on the same timings."""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

__all__ = ["NVRX_INTERVAL", "NVRX_THRESHOLD", "WARM_STEPS", "nvrx_rule", "onset_of", "periods_of", "score_slow"]

WARM_STEPS = 10  # steps of every trial left out of the step-period means (compilation, the first exchange)
NVRX_THRESHOLD = 0.7  # NeMo's StragglerDetectionCallback default (relative performance score)
NVRX_INTERVAL = 10  # steps between two NVRx reports (NVRx reports every report_time_interval seconds)


def onset_of(results: list[dict[str, Any]]) -> int | None:
    onsets = [r["onset"] for r in results if r.get("onset") is not None]
    return min(onsets) if onsets else None


def periods_of(trials: list[list[dict[str, Any]]]) -> list[float]:
    """Every rank's step periods after the warm-up, over the given trials."""
    return [p for r in trials for rank in r for p in rank["periods_s"][WARM_STEPS:]]


def score_slow(results: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Latency, recall, precision of slow trials of one (factor, component)."""
    latencies: list[int] = []
    named = false = 0
    examples: list[dict[str, Any]] = []
    for res in results:
        spec, onset, verdicts = res[0]["trial"], onset_of(res), res[0]["verdicts"]
        good = [
            v
            for v in verdicts
            if onset is not None and v["scope"] == "rank" and v["rank"] == spec["rank"]
            and v["section"] == spec["kind"] and v["step"] >= onset
        ]  # fmt: skip
        bad = [
            v
            for v in verdicts
            if not (v["scope"] == "rank" and v["rank"] == spec["rank"] and v["section"] == spec["kind"]
                    and onset is not None and v["step"] >= onset)
        ]  # fmt: skip
        false += len(bad)
        examples += [{"trial": spec, "onset": onset, **v} for v in bad][:3]
        if good:
            named += 1
            latencies.append(int(good[0]["step"]) - int(onset or 0) + 1)
    ordered = sorted(latencies)
    n = len(results)
    return {
        "trials": n,
        "named": named,
        "recall": named / n if n else None,
        "precision": named / (named + false) if named + false else None,
        "false_verdicts": false,
        "false_examples": examples[:10],
        "latency_steps": latencies,
        "latency_median": statistics.median(latencies) if latencies else None,
        "latency_p90": ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)] if ordered else None,
        "latency_max": ordered[-1] if ordered else None,
    }


def nvrx_rule(results: list[list[dict[str, Any]]], section: str) -> dict[str, Any]:
    """NVRx's section scores on the same timings: every ``NVRX_INTERVAL`` steps, a rank's relative performance score
    is the fastest rank's median time over the interval divided by its own; a rank below ``NVRX_THRESHOLD`` (NeMo's
    default ``gpu_relative_perf_threshold``) is a straggler. ``section`` is what the rule times: ``step`` (the
    training step, as NeMo's callback wraps it) or the slowed component itself."""
    latencies: list[int] = []
    false = 0
    for res in results:
        spec, onset = res[0]["trial"], onset_of(res)
        history = res[0]["history"]
        found = None
        for start in range(0, len(history) - NVRX_INTERVAL + 1, NVRX_INTERVAL):
            window = history[start : start + NVRX_INTERVAL]
            med = np.nanmedian(np.array([h[section] for _, h in window], dtype=np.float64), axis=0)
            if not np.all(np.isfinite(med)) or np.any(med <= 0):
                continue
            score = med.min() / med
            end_step = int(window[-1][0])
            for rank in np.flatnonzero(score < NVRX_THRESHOLD).tolist():
                if rank == spec["rank"] and onset is not None and end_step >= onset:
                    found = found if found is not None else end_step - onset + 1
                else:
                    false += 1
        if found is not None:
            latencies.append(found)
    n = len(results)
    return {
        "section": section,
        "recall": len(latencies) / n if n else None,
        "false_flags": false,
        "latency_median": statistics.median(latencies) if latencies else None,
        "latency_max": max(latencies) if latencies else None,
    }
