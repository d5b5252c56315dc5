"""Draw the goodput timeline (:class:`.timeline.Timeline`) as one picture: ``timeline.png`` and ``timeline.svg``.

Three panels share the wall-clock axis: the step each attempt reached over time (faults, restores, persists and
recomputed steps marked on it), a band of where each second went, and the ETTR breakdown of the whole job.
matplotlib is optional (``pip install lightning-resilience[plots]``): without it nothing is drawn.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from lightning_resilience.report.timeline import BAND_KINDS, AttemptTrack, Timeline

__all__ = ["BAND_COLORS", "draw_timeline"]

BAND_COLORS = {
    "productive": "#2ca02c",
    "startup": "#9e9e9e",
    "recompute": "#ff7f0e",
    "detection": "#d62728",
    "relaunch": "#8c564b",
    "imports": "#e377c2",
    "rendezvous": "#bcbd22",
    "restore": "#1f77b4",
    "teardown": "#c7c7c7",
}
_BAND_LABELS = {
    "productive": "productive training",
    "startup": "startup (setup before the first step)",
    "recompute": "recomputed steps",
    "detection": "fault detection",
    "relaunch": "relaunch (teardown, launcher, new processes)",
    "imports": "imports (interpreter, script up to its callbacks)",
    "rendezvous": "rendezvous (process group, strategy setup)",
    "restore": "checkpoint restore",
    "teardown": "final flush / teardown",
}
_ATTEMPT_COLORS = ("#1f77b4", "#9467bd", "#17becf", "#bcbd22", "#e377c2", "#7f7f7f")


def draw_timeline(timeline: Timeline, out_dir: str | Path, *, name: str = "timeline") -> list[Path]:
    """Write ``<name>.png`` and ``<name>.svg`` into ``out_dir``; returns the files ([] without matplotlib or
    without attempts)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    if not timeline.attempts:
        return []
    fig = plt.figure(figsize=(15, 8.6), layout="constrained")
    grid = fig.add_gridspec(3, 2, height_ratios=[6, 0.8, 1.0], width_ratios=[2.6, 1])
    ax = fig.add_subplot(grid[0, 0])
    _steps_panel(ax, timeline)
    _causes_panel(fig.add_subplot(grid[0, 1]), timeline)
    band_ax = fig.add_subplot(grid[1, :])
    _band_panel(band_ax, timeline, ax)
    _ettr_panel(fig.add_subplot(grid[2, :]), timeline)
    fig.suptitle(_title(timeline), x=0.01, ha="left", fontsize=12, fontweight="bold")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix in ("png", "svg"):
        path = out / f"{name}.{suffix}"
        with plt.rc_context({"svg.fonttype": "none"}):  # text stays text in the SVG: searchable, selectable
            fig.savefig(path, dpi=110)
        written.append(path)
    plt.close(fig)
    return written


def _title(timeline: Timeline) -> str:
    """What the picture shows, and what is good."""
    ettr = timeline.ettr.get("ettr")
    restarts = len(timeline.attempts) - 1
    head = "Goodput timeline of the job"
    if isinstance(ettr, int | float):
        head += f": ETTR {ettr:.1%} of {timeline.wall_s:.0f} s wall-clock was new training (higher is better)"
    return head + f"; {len(timeline.attempts)} attempt(s), {restarts} restart(s)"


def _steps_panel(ax: Any, timeline: Timeline) -> None:
    ymax = max((a.last_step or 0 for a in timeline.attempts), default=1) or 1
    for track in timeline.attempts:
        color = _ATTEMPT_COLORS[track.index % len(_ATTEMPT_COLORS)]
        _attempt_curve(ax, track, color)
        _persists(ax, track)
        _restore(ax, track)
        _fault(ax, track)
    ax.set_title("step reached over time: each attempt, its end (X) and the restore it resumed from (*)", loc="left")
    ax.set_ylabel("optimizer step reached")
    ax.set_xlim(0, max(timeline.wall_s, 1e-3) * 1.02)
    ax.set_ylim(0, ymax * 1.08)
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=False))
    order = sorted(unique, key=lambda label: (not label.startswith("attempt"), label))
    ax.legend([unique[k] for k in order], order, loc="upper left", fontsize=8, framealpha=0.9)


def _attempt_curve(ax: Any, track: AttemptTrack, color: str) -> None:
    if not track.progress:
        return
    times = [t for t, _ in track.progress]
    steps = [s for _, s in track.progress]
    label = f"attempt {track.index}"
    ax.plot(times, steps, color=color, linewidth=2.0, label=label, zorder=3)
    if track.recompute_until is not None:
        cut = track.time_at_step(track.recompute_until)
        redo = [(t, s) for t, s in track.progress if s <= track.recompute_until]
        if cut is not None:
            redo.append((cut, min(track.recompute_until, steps[-1])))
        if len(redo) >= 2:
            ax.plot(
                [t for t, _ in redo],
                [s for _, s in redo],
                color=BAND_COLORS["recompute"],
                linewidth=5,
                alpha=0.55,
                label="steps recomputed (work lost to a fault)",
                zorder=2,
            )


def _persists(ax: Any, track: AttemptTrack) -> None:
    if track.persists:
        ax.scatter(
            [t for t, _, _ in track.persists],
            [s for _, s, _ in track.persists],
            marker="v",
            s=18,
            color="black",
            label="checkpoint committed to disk/remote (when seen)",
            zorder=4,
        )


def _restore(ax: Any, track: AttemptTrack) -> None:
    if track.restored_step is None or track.first_step is None:
        return
    ax.scatter([track.first_step], [track.restored_step], marker="*", s=170, color=BAND_COLORS["restore"], zorder=5)
    source = f" from {track.restored_from}" if track.restored_from else ""
    ax.annotate(
        f"step {track.restored_step}{source}",
        (track.first_step, track.restored_step),
        xytext=(6, -13),
        textcoords="offset points",
        fontsize=8,
        color=BAND_COLORS["restore"],
    )


_KIND_LABELS = {
    "signal": "killed",
    "exit_code": "exit code",
    "exception": "exception",
    "hang": "hang",
    "preemption": "preempted",
    "sdc": "SDC stop",
    "straggler": "straggler stop",
    "no_progress": "no progress",
    "lost": "died, no trace",
}


def _fault(ax: Any, track: AttemptTrack) -> None:
    end = track.end or {}
    cause = end.get("cause")
    if not cause or track.last_heartbeat is None or track.last_step is None:
        return
    color = BAND_COLORS["detection"] if end.get("outcome") == "fault" else "#7f7f7f"
    ax.scatter([track.last_heartbeat], [track.last_step], marker="X", s=140, color=color, zorder=6)
    rank = "?" if cause.get("rank") is None else str(cause["rank"])
    label = f"{track.index}: rank {rank} {_KIND_LABELS.get(str(cause.get('kind')), cause.get('kind'))}"
    ax.annotate(
        label,
        (track.last_heartbeat, track.last_step),
        xytext=(-6, 9),
        textcoords="offset points",
        ha="right",
        fontsize=8,
        fontweight="bold",
        color=color,
        zorder=7,
    )


def _causes_panel(ax: Any, timeline: Timeline, max_attempts: int = 8) -> None:
    """Why each attempt ended, in words: culprit, how, victims, detection, restore."""
    ax.axis("off")
    ax.set_title("why each attempt ended", loc="left")
    shown = timeline.attempts[-max_attempts:]
    lines: list[tuple[str, str, str]] = []  # text, color, weight
    if len(shown) < len(timeline.attempts):
        lines.append((f"({len(timeline.attempts) - len(shown)} earlier attempts not shown)", "#7f7f7f", "normal"))
    for track in shown:
        end = track.end or {}
        outcome = str(end.get("outcome") or ("running" if track.ended is None else "finished"))
        color = BAND_COLORS["detection"] if outcome == "fault" else ("#2ca02c" if outcome == "finished" else "#555555")
        head = f"attempt {track.index}: {outcome}"
        if track.last_step is not None:
            head += f" at step {track.last_step}"
        lines.append((head, color, "bold"))
        cause = end.get("cause")
        if cause:
            rank = "no single rank" if cause.get("rank") is None else f"rank {cause['rank']}"
            inferred = " (inferred)" if "inferred" in (cause.get("evidence") or []) else ""
            text = f"culprit {rank}{inferred}: {cause.get('brief', '')}"
            lines += _wrapped(text, "black", rows=4)
        for victim in (end.get("victims") or [])[:2]:
            text = f"victim rank {victim.get('rank')}: {victim.get('brief') or victim.get('detail')}"
            lines += _wrapped(text, "#555555", rows=2)
        if len(end.get("victims") or []) > 2:
            lines.append((f"  ... {len(end['victims']) - 2} more victims", "#555555", "normal"))
        detection = end.get("detection_s")
        if isinstance(detection, int | float):
            lines.append((f"  detected after {detection:.1f} s", "#555555", "normal"))
        if track.restored_step is not None:
            took = f" in {track.restore_s:.2f} s" if track.restore_s else ""
            lines.append(
                (f"  resumed from step {track.restored_step} ({track.restored_from or '?'}){took}", "#1f77b4", "normal")
            )
        if track.recompute_until is not None and track.start_step is not None:
            lines.append((f"  recomputed {track.recompute_until - track.start_step} steps", "#ff7f0e", "normal"))
    step = 1.0 / max(len(lines) + 1, 24)
    for i, (text, color, weight) in enumerate(lines):
        ax.text(0.0, 1.0 - (i + 0.5) * step, text, transform=ax.transAxes, fontsize=8, color=color, fontweight=weight,
                va="top", family="monospace")  # fmt: skip


def _wrapped(text: str, color: str, *, rows: int, width: int = 52) -> list[tuple[str, str, str]]:
    """``text`` as at most ``rows`` indented lines of the causes panel (the last one cut with an ellipsis)."""
    wrapped = textwrap.wrap(text, width, max_lines=rows, placeholder="…")
    return [(("  " if i == 0 else "    ") + row, color, "normal") for i, row in enumerate(wrapped)]


def _band_panel(ax: Any, timeline: Timeline, steps_ax: Any) -> None:
    for band in timeline.bands:
        ax.broken_barh(
            [(band.start, band.seconds)], (0, 1), color=BAND_COLORS.get(band.kind, "#999999"), label=band.kind
        )
    ax.set_xlim(steps_ax.get_xlim())
    ax.set_yticks([])
    ax.set_xlabel("wall-clock time since the job started (s)")
    ax.set_title("where each second went (green: productive; other colours: time lost)", loc="left", fontsize=9)


def _ettr_panel(ax: Any, timeline: Timeline) -> None:
    wall = timeline.wall_s
    ax.set_yticks([])
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of wall-clock time (%)")
    if wall <= 0:
        return
    # productive, recomputed and blocking time as the ETTR ledger counts them (so the green share is the ETTR);
    # the rest from the bands
    seconds = timeline.seconds_by_kind()
    ettr = timeline.ettr
    parts = [
        ("productive", float(ettr.get("productive_s") or 0.0)),
        ("checkpoint blocking", float(ettr.get("checkpoint_blocking_s") or 0.0)),
        ("recompute", float(ettr.get("recompute_s") or 0.0)),
    ]
    parts += [(kind, seconds.get(kind, 0.0)) for kind in BAND_KINDS if kind not in ("productive", "recompute")]
    accounted = sum(v for _, v in parts)
    if wall - accounted > wall * 0.005:
        parts.append(("other", wall - accounted))
    left = 0.0
    colors = {**BAND_COLORS, "checkpoint blocking": "#98df8a", "other": "#e0e0e0"}
    for kind, value in parts:
        if value <= 0:
            continue
        share = 100.0 * value / wall
        label = f"{_BAND_LABELS.get(kind, kind)}: {value:.1f} s ({share:.1f}%)"
        ax.barh(0, share, left=left, color=colors.get(kind, "#999999"), edgecolor="white", label=label)
        if share >= 7:
            ax.text(left + share / 2, 0, f"{share:.0f}%", ha="center", va="center", fontsize=8, color="white")
        left += share
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.9), ncol=4, fontsize=8, frameon=False)
    ax.set_title("ETTR breakdown: where the job's wall-clock time went", loc="left", fontsize=9)
