"""The Markdown of ``benchmarks.sdc_coverage``: the tables by kind of fault and by cell, the overheads with their
floor and where the time goes, the targets and the notes; the README's line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks._common import fmt_pct, md_table
from benchmarks._sdc.trials import OWN_CORES, WORLD

__all__ = ["OVERHEADS", "TITLE", "readme_summary", "render_markdown", "where"]

TITLE = "SDC verification at the presets' cadence: coverage, localization and latency by kind of fault, and overhead"
_COUNTS = ["trials", "caught", "flagged", "missed", "no effect", "coverage (95% CI)"]
KIND_HEADER = ["kind of fault", *_COUNTS, "localization", "latency mean / max", "caught by"]
CELL_HEADER = ["cell", *_COUNTS, "latency mean / max", "caught by"]

OVERHEADS = (
    ("overhead_own_cores", f"{OWN_CORES} ranks, one per core"),
    ("overhead", f"{WORLD} ranks on 2 cores"),
    ("overhead_large_batch", f"{OWN_CORES} ranks, one per core"),
)


def where(key: str, o: dict[str, Any]) -> str:
    """Which overhead launch, and its tokens a step per rank where the result says."""
    tokens = o.get("tokens_per_step")
    return dict(OVERHEADS)[key] + (f", {tokens} tokens a step per rank" if tokens else "")


def _pair_interval(o: dict[str, Any]) -> str:
    """The 95% interval of the mean over neighbouring window pairs (how precisely the run pins the overhead)."""
    lo_hi = o.get("per_pair_interval95")
    if not lo_hi:
        return ""
    return (f" (per pair of neighbouring windows {fmt_pct(o['per_pair_mean'])}, 95% interval {fmt_pct(lo_hi[0])} "
            f"to {fmt_pct(lo_hi[1])} over {len(o['per_pair'])} pairs)")  # fmt: skip


def render_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"## {TITLE}",
        "",
        f"*Command:* `{result['command']}` · *Date:* {result['date']} · {WORLD} CPU ranks (gloo), tiny GPT, "
        f"{result['config']['trials']} trials per cell"
        + (" · **quick (smoke) run: shortened cadences, not a figure**" if result["config"]["quick"] else ""),
        "",
        "Each preset's monitor exactly as `configs/resilience/sdc/` builds it, driven by the suite's step driver; a "
        "fault lands at a random step of a cadence period after the guards are warm. *caught*: a verdict naming the "
        "faulty rank; *flagged*: detected, no rank (or another) named; *coverage* = caught / (trials - no effect), "
        "with its 95% Wilson interval; *localization* = caught / detected; *latency* in optimizer steps from the "
        "faulty step to the first detection.",
        "",
    ]
    for name, p in result["presets"].items():
        c = p["config"]
        kind_rows = [[k, v["trials"], v["caught"], v["flagged"], v["missed"], v["no_effect"],
                      _pct_ci(v["coverage"], v["coverage_ci95"]), fmt_pct(v["localization"]),
                      _latency(v), _by(v["caught_by"])] for k, v in p["kinds"].items()]  # fmt: skip
        cell_rows = [[k, v["trials"], v["caught"], v["flagged"], v["missed"], v["no_effect"],
                      _pct_ci(v["coverage"], v["coverage_ci95"]), _latency(v), _by(v["caught_by"])]
                     for k, v in p["cells"].items()]  # fmt: skip
        lines += [
            f"### Preset `{name}`: guards (read lag {c['guard_read_lag']}), replay every "
            f"{c['replay_every_n_steps'] or 'never'} ({c['replay_scope']}), reconciliation every "
            f"{c['reconcile_every_n_steps']}, "
            f"communication hook {'on' if c['ddp_fingerprint'] else 'off'}",
            "",
            md_table(KIND_HEADER, kind_rows),
            "",
            *(
                f"Step-time overhead against the true plain arm, {where(key, p[key])} "
                f"({p[key]['steps_each']} steps each, "
                f"interleaved windows of {p[key].get('window_steps', p['window_steps'])}): mean "
                f"{fmt_pct(p[key]['slowdown_mean'])}{_pair_interval(p[key])}, median "
                f"{fmt_pct(p[key]['slowdown_median'])}, p99 {fmt_pct(p[key]['slowdown_p99'])}.{_floor(p[key])}"
                f"{_parts(p[key])}\n"
                for key, _ in OVERHEADS
                if key in p
            ),
            f"A device that corrupts every step is met by a scheduled replay within {p.get('faulty_bound_steps')} "
            "steps (the stated bound: each faulty-device trial runs that long after its onset).",
            "",
            "<details><summary>Per cell</summary>",
            "",
            md_table(CELL_HEADER, cell_rows),
            "",
            "</details>",
            "",
        ]
    stale = result.get("stale_saves")
    if stale:
        lines += [
            f"Stale saves (a tier commits the previous step's tensors under a new name, {stale['trials']} trials): "
            f"refused at the restore {stale['refused']}, the step before it restored {stale['restored_step_before']}"
            f" (coverage {_pct_ci(stale['coverage'], stale['coverage_ci95'])}).",
            "",
        ]
    lines += [
        md_table(
            ["target", "value", "goal", "verdict"],
            [[t["name"], _num(t["value"]), f"{t['op']} {t['threshold']:g}", t["verdict"]] for t in result["targets"]],
        ),
        "",
        *(f"* {n}" for n in result["notes"]),
    ]
    return "\n".join(lines)


def _floor(o: dict[str, Any]) -> str:
    """The arm of the bare checks, in the same interleaved run (results from before it was measured have none)."""
    if "floor_slowdown_mean" not in o:
        return ""
    return (
        f" The physical floor (a third arm in the same windows: the same local arithmetic at the same cadences, the "
        f"gradient and parameter norms, the state's digest and a replay's forward and backward, with no bookkeeping, "
        f"agreement or collective) costs {fmt_pct(o['floor_slowdown_mean'])}; the monitored arm is "
        f"{fmt_pct(o['beyond_floor_mean'])} above it."
    )


def _parts(o: dict[str, Any]) -> str:
    """Where the monitored arm's time goes (rank 0), from the monitor's and the driver's own counters."""
    parts, rounds = o.get("parts_ms_per_step"), o.get("rounds")
    if not parts or not rounds:
        return ""
    plain_ms = o["plain_step_mean_s"] * 1e3
    each = "; ".join(f"{k} {v:.3f} ({fmt_pct(v / plain_ms)})" for k, v in parts.items())
    phases = o.get("driver_phases_ms_per_step") or []
    issue = ", ".join(f"{r.get('begin', 0.0):.2f}" for r in phases)
    fired = ", ".join(f"{k} {v}" for k, v in sorted((rounds.get("guards_fired") or {}).items())) or "none"
    return (
        f" Where the monitored arm's time goes (rank 0, ms per step, share of the plain step's {plain_ms:.1f} ms): "
        f"{each} ({rounds['replay']} replay and {rounds['reconcile']} reconciliation rounds in "
        f"{rounds['steps']} steps; guards that fired on these clean steps: {fired}). The driver's issue phase "
        f"(its contributors' values and the hand-off of the round to the agreement thread), ms per step by rank: "
        f"{issue}."
    )


def _pct_ci(value: float | None, ci: Sequence[float] | None) -> str:
    return fmt_pct(value) + (f" ({fmt_pct(ci[0])} to {fmt_pct(ci[1])})" if ci else "")


def _latency(cell: dict[str, Any]) -> str:
    return f"{_num(cell['latency_steps_mean'])} / {_num(cell['latency_steps_max'])}"


def _by(caught_by: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(caught_by.items())) or "-"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def readme_summary(result: dict[str, Any]) -> str:
    parts = []
    for name, p in result["presets"].items():
        kinds, o = p["kinds"], p["overhead"]
        got = ", ".join(f"{k.replace('_', ' ')} {fmt_pct(v['coverage'])}" for k, v in kinds.items())
        own = p.get("overhead_own_cores")
        cost = f"{fmt_pct(o['slowdown_mean'])} mean step time ({WORLD} ranks on 2 cores)"
        large = p.get("overhead_large_batch")
        if own:
            cost = (f"{fmt_pct(own['slowdown_mean'])} mean step time with one rank per core ("
                    + (f"{fmt_pct(large['slowdown_mean'])} with {large['tokens_per_step']} tokens a step per rank "
                       f"instead of {own.get('tokens_per_step', 256)}; " if large else "")
                    + f"{fmt_pct(o['slowdown_mean'])} with {WORLD} ranks on 2 cores)")  # fmt: skip
            if "floor_slowdown_mean" in own:
                cost += f", against a floor of {fmt_pct(own['floor_slowdown_mean'])} for the bare checks"
        parts.append(f"`resilience={name}` names the rank for {got} at {cost}")
    return "**SDC** (faults by kind on 3 DDP ranks, at the presets' cadence): " + "; ".join(parts) + "."
