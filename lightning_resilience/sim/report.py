"""Tables (Markdown) and plots (PNG, when matplotlib is installed) of simulation results and sweeps."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_resilience.sim.engine import CATEGORIES, SimResult

__all__ = ["breakdown_table", "have_matplotlib", "plot_sweep", "sweep_table"]


def _cell(v: Any) -> str:
    return str(v).replace("|", "\\|")


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def breakdown_table(result: SimResult) -> str:
    """Where the wall time went: seconds, hours and share per category."""
    fr = result.breakdown.fractions()
    rows = [(c, f"{getattr(result.breakdown, c) / 3600:.2f}", f"{100 * fr[c]:.2f}%") for c in CATEGORIES]
    rows.append(("**ETTR**", f"{result.wall_s / 3600:.2f} (wall)", f"**{100 * result.ettr:.2f}%**"))
    return _table(["category", "hours", "share of wall time"], rows)


def sweep_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (scale, interval): ETTR, the largest losses, failures and the analytic optima."""
    out = []
    for r in rows:
        fr = r["breakdown_fraction"]
        out.append(
            (
                r["gpus"],
                _duration(r["job_mttf_s"]),
                r["tier"],
                _duration(r["interval_s"]),
                f"{100 * r['ettr_mean']:.2f}% ± {100 * r['ettr_stderr']:.2f}",
                f"{100 * fr['checkpoint']:.2f}%",
                f"{100 * fr['lost']:.2f}%",
                f"{100 * (fr['detection'] + fr['restart'] + fr['restore']):.2f}%",
                f"{r['failures_mean']:.0f}",
                _duration(r["daly_interval_s"]),
            )
        )
    header = ["GPUs", "job MTTF", "tier", "interval", "ETTR", "ckpt", "lost", "down", "failures", "Daly interval"]
    return _table(header, out)


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot_sweep(rows: Sequence[dict[str, Any]], path: str | Path) -> Path | None:
    """ETTR against interval, one line per scale, Daly's interval marked; None (nothing written) without matplotlib."""
    if not have_matplotlib():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in sorted({r["gpus"] for r in rows}):
        pts = sorted((r for r in rows if r["gpus"] == n), key=lambda r: r["interval_s"])
        xs = [r["interval_s"] / 60 for r in pts]
        line = ax.plot(xs, [100 * r["ettr_mean"] for r in pts], marker="o", label=f"{n} GPUs")[0]
        if pts and pts[0]["daly_interval_s"] is not None:
            ax.axvline(pts[0]["daly_interval_s"] / 60, color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (minutes of training); dotted: Daly optimum")
    ax.set_ylabel("ETTR (%)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
