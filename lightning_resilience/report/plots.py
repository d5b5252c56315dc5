"""The report's pictures: the job's goodput timeline, step time per rank, checkpoint blocking per snapshot.

matplotlib is optional (``pip install lightning-resilience[plots]``): without it no picture is drawn and nothing
fails. Every picture says in its title what is good and what is bad, with units on its axes.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from lightning_resilience.report.model import ResilienceReport
from lightning_resilience.report.timeline import Timeline
from lightning_resilience.report.timeline_plot import draw_timeline

__all__ = ["plot"]


def plot(report: ResilienceReport, out_dir: str | Path) -> list[Path]:
    """Write the pictures the report holds data for; returns the files written ([] without matplotlib).

    * ``timeline.png`` / ``timeline.svg``: the goodput timeline of the whole job (from ``report.timeline``);
    * ``step_times_per_rank.png``: median step time per rank, from any section with ``step_time_median_s``
      (the straggler section) or ``step_times_s`` (rows of per-rank times per step, drawn as lines);
    * ``checkpoint_blocking.png``: what each snapshot blocked the training loop, over steps.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if report.timeline is not None:
        written += [p for p in draw_timeline(Timeline.from_json(report.timeline), out) if p.suffix == ".png"]
    for name, section in report.sections.items():
        fig = _step_times_figure(plt, name, section)
        if fig is not None:
            written.append(_save(plt, fig, out / "step_times_per_rank.png"))
            break
    timeline = (report.sections.get("checkpoint") or {}).get("blocking_timeline")
    if isinstance(timeline, list) and timeline:
        fig = _blocking_figure(plt, timeline, report.step_seconds)
        written.append(_save(plt, fig, out / "checkpoint_blocking.png"))
    return written


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _ms(value: Any) -> float:
    return float(value) * 1e3 if isinstance(value, int | float) and math.isfinite(value) else math.nan


def _step_times_figure(plt: Any, name: str, section: dict[str, Any]) -> Any:
    series = section.get("step_times_s")
    medians = section.get("step_time_median_s")
    if isinstance(series, list) and series and all(isinstance(r, list) for r in series):
        fig, ax = plt.subplots(figsize=(9, 4))
        ranks = max(len(r) for r in series)
        for rank in range(ranks):
            ys = [_ms(r[rank]) if rank < len(r) else math.nan for r in series]
            ax.plot(range(len(series)), ys, label=f"rank {rank}", linewidth=0.8)
        ax.set_xlabel("sample (one per gathered step)")
        ax.set_ylabel("step time (ms)")
        if ranks <= 16:
            ax.legend(fontsize="small", ncol=min(ranks, 8))
        ax.set_title(
            f"Step time per rank ({name})\nlower is better; a line above the others is a straggler", fontsize=10
        )
        return fig
    if not (isinstance(medians, list) and medians):
        return None
    ys = [_ms(v) for v in medians]
    fig, ax = plt.subplots(figsize=(max(5.0, min(0.35 * len(ys) + 3, 16)), 4))
    rank_ids = list(range(len(ys)))
    finite = [y for y in ys if math.isfinite(y)]
    reference = statistics.median(finite) if finite else math.nan
    colors = ["#d62728" if math.isfinite(y) and y > 1.1 * reference else "#1f77b4" for y in ys]
    ax.bar(rank_ids, [y if math.isfinite(y) else 0.0 for y in ys], color=colors, width=0.7)
    if math.isfinite(reference):
        ax.axhline(reference, color="black", linestyle="--", linewidth=0.8, label=f"median of ranks {reference:.1f} ms")
        ax.legend(fontsize="small", loc="lower right")
    stride = max(1, len(rank_ids) // 32)  # at most ~32 labelled ticks, always whole ranks
    ax.set_xticks(rank_ids[::stride])
    ax.set_xlim(-0.6, len(rank_ids) - 0.4)
    ax.set_xlabel("rank")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(
        f"Median step time per rank ({name})\nlower is better; red: >10% above the median of ranks", fontsize=10
    )
    return fig


def _blocking_figure(plt: Any, timeline: list[Any], step_seconds: float | None) -> Any:
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot([p[0] for p in timeline], [_ms(p[1]) for p in timeline], marker=".", linewidth=0.8, label="per snapshot")
    if step_seconds:
        ax.axhline(step_seconds * 10.0, color="#d62728", linestyle="--", linewidth=0.8, label="1% of a step (budget)")
        ax.legend(fontsize="small")
    ax.set_xlabel("step")
    ax.set_ylabel("training loop blocked (ms)")
    ax.set_title("Checkpoint blocking per snapshot: time training waited; lower is better")
    return fig
