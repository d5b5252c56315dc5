"""What a detector shows: JSON-able figures for the report, a compact table for the end of a run, a PNG of per-rank
times with the verdicts marked."""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Callable, Reversible
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lightning_resilience.straggler.scores import leave_one_out_reference, nanmedian
from lightning_resilience.straggler.timing import COMPUTE, DATA, STEP, WAIT

if TYPE_CHECKING:
    from lightning_resilience.straggler.detector import StragglerDetector

__all__ = ["plot", "report", "summary"]

log = logging.getLogger(__name__)


def report(det: StragglerDetector) -> dict[str, Any]:
    """Per-rank statistics per section, verdicts (rank and job), noise-level confirmations and decisions."""
    sections: dict[str, Any] = {}
    board = det.scoreboard
    for i, name in enumerate(det.sections):
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = board.rel_sum[i] / board.rel_count[i]
        sections[name] = {
            "relative_mean": [_num(v) for v in mean],
            "relative_max": [_num(v) for v in board.rel_max[i]],
            "relative_last": [_num(v) for v in board.relative[i]],
            "individual_last": [_num(v) for v in board.individual[i]],
            "noise_scale": [_num(v) for v in board.scale(name)],
        }
    return {
        "world_size": det.world_size,
        "mode": det.mode,
        "sections_tested": list(det.sections),
        "probed": det.probe.parallelism,
        "gathers": det.gathers,
        "gather_seconds": det.gather_seconds,
        "nodes": list(det.nodes),
        "node_index": list(det.node_index),
        "step_time_median_s": [_num(v) for v in _median_per_rank(det, STEP)],
        "compute_median_s": [_num(v) for v in _median_per_rank(det, COMPUTE)],
        "data_median_s": [_num(v) for v in _median_per_rank(det, DATA)],
        "sections": sections,
        "job_slowdown_last": _num(board.job_last),
        "verdicts": [v.to_dict() for v in det.verdicts],
        "noise_level": [v.to_dict() for v in det.noise_level],
        "decisions": [d.to_dict() for d in det.decisions],
        "active": [v.to_dict() for v in det.active],
        "should_stop": det.should_stop,
    }


def summary(det: StragglerDetector, max_rows: int = 16) -> str:
    """The slowest ranks (by their mean relative score in the first tested section), then what was decided."""
    name, board = det.sections[0], det.scoreboard
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = board.rel_sum[0] / board.rel_count[0]
    rel_max = board.rel_max[0]
    steps, computes = _median_per_rank(det, STEP), _median_per_rank(det, COMPUTE)
    order = sorted(range(det.world_size), key=lambda r: -(mean[r] if np.isfinite(mean[r]) else -1.0))
    rank_verdicts = sum(v.scope == "rank" for v in det.verdicts)
    lines = [
        f"straggler detection: {det.world_size} rank(s), {det.gathers} exchanges, {rank_verdicts} straggler "
        f"verdict(s), {len(det.verdicts) - rank_verdicts} job verdict(s), {len(det.decisions)} action(s)"
        f"{', STOP requested' if det.should_stop else ''}",
        f"  {'rank':>4}  {'node':<16} {'step med':>9} {'compute med':>11}  {name + ' rel mean':>16}  {'rel max':>7}",
    ]
    for r in order[:max_rows]:
        node = f"{det.node_index[r]}:{det.nodes[r]}"[:16]
        lines.append(
            f"  {r:>4}  {node:<16} {_fmt_s(steps[r]):>9} {_fmt_s(computes[r]):>11}  {_fmt_x(mean[r]):>16}  "
            f"{_fmt_x(rel_max[r]):>7}"
        )
    if det.world_size > max_rows:
        lines.append(f"  ... {det.world_size - max_rows} more rank(s)")
    for d in det.decisions[-8:]:
        lines.append(f"  step {d.step}: {d.action.value}: {d.verdict.describe()}")
    if det.noise_level:
        worst = max(det.noise_level, key=lambda v: v.slowdown)
        lines.append(
            f"  {len(det.noise_level)} noise-level confirmation(s), not verdicts (largest {worst.slowdown:.2f}x "
            f"against a jitter of {worst.noise:.0%}): the machine's noise, nothing to act on"
        )
    return "\n".join(lines)


def plot(det: StragglerDetector, path: str | os.PathLike[str]) -> Path | None:
    """PNG of the per-rank compute and data times with the verdicts marked; None (nothing written) without
    matplotlib or samples."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("straggler: matplotlib is not installed; no plot written")
        return None
    if not det.history:
        return None
    steps = [s for s, _ in det.history]
    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for ax, section in zip(axes, (COMPUTE, DATA)):
        arr = np.array([t[section] for _, t in det.history], dtype=np.float64)
        for r in range(det.world_size):
            ax.plot(steps, arr[:, r] * 1e3, lw=0.8, label=f"rank {r}" if det.world_size <= 16 else None)
        for v in det.verdicts:
            if v.section == section or v.scope == "job":
                ax.axvline(v.step, color="red", ls="--", lw=0.8)
                who = "job" if v.scope == "job" else f"rank {v.rank}"
                ax.annotate(f"{who} {v.slowdown:.2f}x", (v.step, ax.get_ylim()[1]), fontsize=7, color="red")
        ax.set_ylabel(f"{section} (ms)")
    axes[0].set_title("per-rank compute (collective waits excluded) and data wait")
    axes[-1].set_xlabel("step")
    if det.world_size <= 16:
        axes[0].legend(fontsize=7, ncol=4)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out


def _median_per_rank(det: StragglerDetector, section: str) -> list[float]:
    if not det.history:
        return [math.nan] * det.world_size
    arr = np.array([t[section] for _, t in det.history], dtype=np.float64)
    out = []
    for j in range(arr.shape[1]):
        col = arr[:, j][np.isfinite(arr[:, j])]
        out.append(float(np.median(col)) if col.size else math.nan)
    return out


def _num(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


def _fmt_s(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value * 1e3:.1f} ms"


def _fmt_x(value: float) -> str:
    return "n/a" if not np.isfinite(value) else f"{value:.2f}x"


def wait_evidence(history: Reversible[tuple[int, dict[str, np.ndarray]]], last: int) -> Callable[[int], str]:
    """Who waits for whom over the ``last`` gathered steps of ``history``, for any rank: the median of the other
    ranks' median collective wait per step, and the rank's own ('' when waits are not measured). Read once for all
    the verdicts of a step (a few NumPy calls over N ranks, not a Python float each)."""
    read: list[tuple[np.ndarray, np.ndarray]] = []

    def evidence(rank: int) -> str:
        if not read:
            tail = list(itertools.islice(reversed(history), last))  # the newest ``last``, never the whole history
            own = nanmedian(np.stack([s[WAIT] for _, s in tail]), 0) if tail else np.empty(0)
            read.append((own, leave_one_out_reference(own)))
        own, others = read[0]
        if not (rank < own.size and math.isfinite(own[rank]) and math.isfinite(others[rank])):
            return ""
        return (
            f"the other ranks waited {others[rank] * 1e3:.1f} ms per step in collectives, "
            f"rank {rank} {own[rank] * 1e3:.1f} ms"
        )

    return evidence
