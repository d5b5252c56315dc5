"""The Markdown of ``benchmarks.straggler_detection``: the real ranks' tables and overheads, the synthetic
cross-check, the targets."""

from __future__ import annotations

from typing import Any

from benchmarks._common import fmt_interval, fmt_pct, md_table
from benchmarks._straggler.scoring import NVRX_INTERVAL, NVRX_THRESHOLD

__all__ = ["f2", "render_markdown"]


def _blocks(o: dict[str, Any]) -> str:
    return f"; block by block {fmt_interval(o['per_block'], 'blocks')}" if len(o.get("per_block") or []) > 1 else ""


def f2(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _val(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def render_markdown(r: dict[str, Any], *, heading: str = "##") -> str:
    """Markdown tables of one result (also printed at the end of a run)."""
    m, cfg = r["machine"], r["config"]
    out = [f"{heading} {r['title']}", ""]
    out.append(
        f"*Command:* `{r['command']}` · *Date:* {r['date']} · *Run time:* {r['total_wall_s'] / 60:.1f} min · "
        f"{m['cpu_count']} cores ({m['cpu_model']}), torch {m['torch']}; load average at the end "
        f"{_val((m.get('loadavg_at_end') or [None])[0])}."
    )
    out += [
        "",
        f'**Real ranks.** `torchrun` with {cfg["world"]} CPU ranks (gloo), Lightning `strategy="ddp"`, a plain '
        "`DataLoader(shuffle=True)`, the default `StragglerDetection()`, real clocks. One random rank becomes "
        "slower from a random onset, in its forward (compute) or its data loader (data), by a stall of "
        "(factor - 1) x the measured step period. Workload `device`: the forward also waits a fixed 60 ms, as a "
        "host waits for an accelerator; `cpu`: all real CPU compute. Latency = slow steps seen up to the verdict, "
        f"inclusive. *NVRx rule*: NVRx's relative section score (fastest rank's median / this rank's, every "
        f"{NVRX_INTERVAL} steps, flagged below {NVRX_THRESHOLD}, NeMo's default) on the same timings, of the whole "
        "training step (what NeMo's callback wraps; CUPTI kernel scores need a GPU) and of the slowed component.",
        "",
    ]
    for name, w in r["real"].items():
        rows = []
        for g in w["groups"].values():
            nv = g.get("nvrx_rule") or {}
            step_rule, own_rule = nv.get("step") or {}, nv.get(g["kind"]) or {}
            rows.append(
                [name, g["kind"], f"{g['factor']}x", g["trials"], f2(g["recall"]), f2(g["precision"]),
                 g["latency_median"], g["latency_p90"], g["latency_max"], f2(step_rule.get("recall")),
                 f"{f2(own_rule.get('recall'))} ({own_rule.get('latency_max')}; {own_rule.get('false_flags')} false)"
                 if own_rule else ""]
            )  # fmt: skip
        j = w["job"]
        rows.append([name, "job-wide", "1.5x", j["trials"], f2(j["named"] / j["trials"] if j["trials"] else None),
                     "", "", "", j["latency_max"], "", ""])  # fmt: skip
        header = ["workload", "slow", "factor", "trials", "recall", "precision", "latency median", "p90", "max"]
        header += ["NVRx rule on the step: recall", "NVRx rule on the component: recall (max latency; false flags)"]
        out.append(md_table(header, rows))
        c, o = w["clean"], w["overhead"]
        out += [
            "",
            f"`{name}`: **{c['false_verdicts']}** false verdict(s) in {c['steps']} clean steps "
            f"({c['noise_level']} noise-level confirmation(s), never acted on) and "
            f"{c['pre_onset_false_verdicts']} in the {c['pre_onset_steps']} steps before the onsets. Overhead: mean "
            f"step period {o['step_period_with_detector']['mean_s'] * 1e3:.1f} ms with the detector vs "
            f"{o['step_period_plain']['mean_s'] * 1e3:.1f} ms without (interleaved) = "
            f"**{fmt_pct(o['mean_fraction'])}** (p99 {fmt_pct(o['p99_fraction'])}){_blocks(o)}; on the training "
            f"thread: the callback's hooks {o['hooks_s_per_step_mean'] * 1e3:.2f} ms a step"
            + (
                f" and the step driver (the round's issue, the detector's step end, the agreement taken) "
                f"{o['driver_s_per_step_mean'] * 1e3:.2f} ms, together {fmt_pct(o['training_thread_fraction'])} of "
                f"the median step; an exchange's latency (issue to taken, on the agreement thread) "
                f"{o['exchange_latency_s_per_step_mean'] * 1e3:.2f} ms a step."
                if "driver_s_per_step_mean" in o
                else f" = {fmt_pct(o['hooks_fraction'])} of the median step."
            ),
        ]
        if o.get("own_mean_fraction") is not None:
            own = o["own_per_block"]
            out.append(
                f"Apart: the suite's step path alone (`ResiliencePolicy()`: the step driver and its one agreement a "
                f"step, which every preset has) {o['step_period_path']['mean_s'] * 1e3:.1f} ms = "
                f"**{fmt_pct(o['path_mean_fraction'])}** over none (its driver "
                f"{o['path_driver_s_per_step_mean'] * 1e3:.2f} ms a step on the training thread); the detector's own "
                f"share, with it against the step path alone: **{fmt_pct(o['own_mean_fraction'])}** (p99 "
                f"{fmt_pct(o['own_p99_fraction'])})"
                + (f"; block by block {fmt_interval(own, 'blocks')}." if len(own) > 1 else ".")
            )
        out.append("")
    s = r["synthetic"]
    rows = [
        [g["kind"], f"{g['factor']}x", g["trials"], f2(g["recall"]), f2(g["precision"]), g["latency_median"],
         g["latency_max"]]
        for g in s["groups"].values()
    ]  # fmt: skip
    out += [
        f"**Synthetic** (cross-check at scale, not a measurement): {s['world']} simulated ranks through the real "
        "detector with fake clocks; every step every rank waits in a modelled collective until the slowest arrives "
        f"(whole-step times equal, as under DDP). {s['clean']['false_verdicts']} false verdict(s) in "
        f"{s['clean']['steps']} clean steps.",
        "",
        md_table(["slow", "factor", "trials", "recall", "precision", "latency median", "max"], rows),
    ]
    trows = [
        [t["name"], _val(t["value"]), f"{t['op']} {t['threshold']} {t['unit']}", t["verdict"], t["note"]]
        for t in r["targets"]
    ]
    out += ["", md_table(["target (real ranks)", "measured", "goal", "verdict", "how"], trows), ""]
    return "\n".join(out)
