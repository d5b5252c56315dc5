"""Markdown of the checkpoint benchmark's result: its section of docs/benchmarks.md and its README line."""

from __future__ import annotations

from typing import Any

from benchmarks._common import fmt_ms, fmt_pct, fmt_ratio, md_table

__all__ = ["TITLE", "readme_summary", "render_markdown"]

TITLE = "Checkpoint every step: step-time slowdown, blocking and restore"

_NOTES = {
    "none": "no checkpointing",
    "ours": "RAM every step + local disk every 10 (default preset), overlapped copy",
    "dcp_best_thread": "dcp.async_save, reused DefaultStager, staging waited before optimizer.step, thread executor",
    "dcp_best_process": "the same, process executor",
}


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.1f}%"


def _where(r: dict[str, Any]) -> str:
    cfg, m = r["config"], r["machine"]
    device = m.get("device") or f"CPU ({m['cpu_count']} cores, {m['cpu_model']})"
    return (
        f"GPT `{cfg['preset']}`: {cfg['params'] / 1e6:.1f}M parameters ({cfg['dtype']}), AdamW, "
        f"{cfg['state_bytes'] / 1e6:.0f} MB of model+optimizer state, batch {cfg['batch_size']} x "
        f"{cfg['model']['seq_len']} tokens, on {device}; torch {m['torch']}, Lightning {m['lightning']}; 1-min load "
        f"average {(m.get('loadavg_at_start') or [float('nan')])[0]:.1f} at start, "
        f"{(m.get('loadavg_at_end') or [float('nan')])[0]:.1f} at end"
    )


def render_markdown(r: dict[str, Any], *, heading: str = "##") -> str:
    cfg, sub = r["config"], heading + "#"
    slow, steps, blocking, rt = r["slowdown"], r["step_time"], r["blocking"], r["ratios"]
    out = [f"{heading} {TITLE}", "", _where(r) + ".", ""]
    out.append(
        f"*Command:* `{r['command']}` · *Date:* {r['date']} · *Run time:* {r['total_wall_s'] / 60:.1f} min"
        + (" · **quick (smoke) run: not a figure to publish**" if cfg["quick"] else "")
    )
    out += [
        "",
        f"Method: one training loop; each contender trains {cfg['turn']} consecutive steps in turn, {cfg['rounds']} "
        f"rounds (order reversed every other round), after {cfg['warmup']} untimed steps each. A step's time runs from "
        "its start to the next step's start, so a wait inside the next step (an optimizer pre-hook) and the drain of "
        "background work at the end of a turn count against the contender that caused them. DCP at its best: one "
        "reused `DefaultStager(StagingOptions(use_pinned_memory, use_shared_memory=True, use_async_staging=True, "
        "use_non_blocking_copy))` (pinned memory and non-blocking copies only exist with a GPU), the wait on "
        "`staging_completion` in an optimizer pre-hook, the previous `upload_completion` waited before the next save "
        "(torchtitan's `async_with_pinned_mem`), into "
        + ("a tmpfs directory (RAM)" if cfg["dcp_ram_dir_is_tmpfs"] else "a disk directory (no /dev/shm)")
        + " every step and the local disk every 10 steps: the same cadence as ours.",
        "",
        f"{sub} Step-time slowdown (per-step snapshots)",
        "",
    ]
    rows = []
    for name, s in steps.items():
        sl = slow.get(name, {})
        rows.append(
            [
                f"**{name}**" if name == "ours" else name,
                fmt_ms(s["mean_s"]),
                fmt_ms(s["median_s"]),
                fmt_ms(s["p99_s"]),
                _pct(sl.get("mean")) if sl else "",
                _pct(sl.get("median")) if sl else "",
                _pct(sl.get("p99")) if sl else "",
                fmt_ms(blocking[name]["mean_s"]) if name in blocking else "",
                _NOTES.get(name, ""),
            ]
        )
    out.append(
        md_table(
            [
                "contender",
                "mean step",
                "median",
                "p99",
                "slowdown (mean)",
                "(median)",
                "(p99)",
                "blocking / step",
                "what",
            ],
            rows,
        )
    )
    best = rt["best_dcp"]
    turns = slow["ours"]["per_turn"]
    out += [
        "",
        f"DCP at its best here is `{best}`: it slows the mean step {fmt_ratio(rt['dcp_over_ours_slowdown_mean'])} as "
        f"much as ours (p99: {fmt_ratio(rt['dcp_over_ours_slowdown_p99'])}) and blocks the training thread "
        f"{fmt_ratio(rt['dcp_over_ours_blocking_mean'])} as long. Ours per turn against the neighbouring `none` turn: "
        + (f"{min(turns) * 100:+.1f}% to {max(turns) * 100:+.1f}%" if turns else "n/a")
        + " (the machine's drift). *Blocking* is the training thread's own time in the checkpoint calls and hooks; "
        "the slowdown also holds what the background copy and writes take from the training thread's cores.",
    ]
    pl = r.get("lightning") or {}
    if pl:
        prow = []
        for kind, mean in pl["mean_step_with_drain_s"].items():
            si = pl["step_interval"][kind]
            prow.append(
                [
                    kind,
                    fmt_ms(mean),
                    fmt_ms(si["median_s"]),
                    fmt_ms(si["p99_s"]),
                    _pct(pl["slowdown"].get(kind)) if kind != "none" else "",
                ]
            )
        out += [
            "",
            f"{sub} Through Lightning",
            "",
            "`TieredCheckpoint` with the default preset's tiers against `ModelCheckpoint(every_n_train_steps=1)` + "
            "`AsyncCheckpointIO` and a Trainer without checkpointing, Trainer runs in alternating order. The mean "
            "step runs from the first measured step to the end of `fit`, so the drain of queued saves after the last "
            "step is counted.",
            "",
            md_table(
                ["Trainer", "mean step (drain counted)", "median interval", "p99 interval", "slowdown (mean)"], prow
            ),
        ]
    rs = r["restore"]
    names = {
        "ours_ram": "ours, RAM tier",
        "ours_disk_warm": "ours, local disk (page cache warm)",
        "ours_disk_cold": "ours, local disk (page cache evicted)",
        "dcp_ram": "DCP, tmpfs (RAM)",
        "dcp_disk_warm": "DCP, local disk (warm)",
        "dcp_disk_cold": "DCP, local disk (evicted)",
    }
    ram = rs["ours_ram"]["total"]["median_s"]
    rrows = [
        [
            names.get(k, k),
            fmt_ms(v["restore"]["median_s"]),
            fmt_ms(v["apply"]["median_s"]),
            fmt_ms(v["total"]["median_s"]),
            fmt_ratio(v["total"]["median_s"] / ram if ram else None),
        ]
        for k, v in rs.items()
    ]
    out += [
        "",
        f"{sub} Restore, `load_state_dict` included",
        "",
        "What a user waits for before the next step: read the state and load it into the live model and optimizer "
        f"(medians of {cfg['restore_reps']}, interleaved).",
        "",
        md_table(["from", "read", "load_state_dict", "total", "vs ours RAM"], rrows),
        "",
        f"{sub} Targets",
        "",
        md_table(
            ["target", "value", "goal", "verdict", "note"],
            [[t["name"], _value(t), f"{t['op']} {t['threshold']:g}", t["verdict"], t["note"]] for t in r["targets"]],
        ),
    ]
    if not r["machine"].get("device"):
        out += [
            "",
            "**CPU only.** On this machine the background copy and the disk write share two cores with training, so "
            "the slowdown above is mostly that competition. On a GPU the snapshot is a device-to-host copy on a side "
            "stream into pinned memory that overlaps the next forward and backward, and the optimizer step waits for "
            "it on the device, not the host: the GPU figures come from `python -m benchmarks.gpu_check` (its own "
            "section; pending until a GPU run is recorded).",
        ]
    return "\n".join(out) + "\n"


def _value(t: dict[str, Any]) -> str:
    v = t["value"]
    if v is None:
        return "n/a"
    return fmt_pct(v) if t["unit"] == "fraction" else f"{v:.2f}{t['unit']}"


def readme_summary(r: dict[str, Any]) -> str:
    """The README line of this benchmark (generated; a test checks the README holds it)."""
    cfg, slow, rt, rs = r["config"], r["slowdown"], r["ratios"], r["restore"]
    best = rt["best_dcp"]
    ours = slow["ours"]
    device = r["machine"].get("device") or "CPU"
    text = (
        f"**checkpoint every step** ({cfg['params'] / 1e6:.0f}M-parameter GPT + AdamW, "
        f"{cfg['state_bytes'] / 1e6:.0f} MB of state, {device}): "
        f"RAM snapshots every step + local disk every 10 slow the step by {_pct(ours['mean'])} mean "
        f"({_pct(ours['median'])} median, {_pct(ours['p99'])} p99); PyTorch DCP at its best at the same cadence "
        f"(`async_save`, reused stager, {best.removeprefix('dcp_best_')} executor) by {_pct(slow[best]['mean'])} "
        f"({fmt_ratio(rt['dcp_over_ours_slowdown_mean'])} ours)"
    )
    pl = r.get("lightning") or {}
    if pl:
        text += (
            f"; through Lightning `TieredCheckpoint` {_pct(pl['slowdown']['tiered'])} against "
            f"{_pct(pl['slowdown']['modelcheckpoint_async'])} for `ModelCheckpoint` + `AsyncCheckpointIO` every step "
            "(drain counted)"
        )
    text += (
        f"; a restore from RAM, `load_state_dict` included, takes {fmt_ms(rs['ours_ram']['total']['median_s'])}, "
        f"{fmt_ratio(rt['restore_disk_warm_over_ram'])} faster than from a warm local disk."
    )
    return text
