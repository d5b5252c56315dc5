"""Markdown of the checkpoint benchmark's result: its section of docs/benchmarks.md and its README line."""

from __future__ import annotations

from typing import Any

from benchmarks._checkpoint.scenarios import LIGHTNING_KINDS
from benchmarks._common import fmt_ms, fmt_pct, fmt_ratio, load_line, md_table, tail_key

__all__ = ["README_PENDING", "TITLE", "readme_summary", "render_markdown"]

TITLE = "Checkpoint every step: step-time slowdown against the bare-copy floor, blocking and restore"

README_PENDING = (
    "**checkpoint every step, against the bare-copy floor**: pending a run on a quiet machine "
    "(`python -m benchmarks.checkpoint`)."
)

_NOTES = {
    "none": "no checkpointing",
    "floor": "bare copy_ of the state into host buffers allocated once, each step (the floor)",
    "ours_ram": "our RAM tier every step, overlapped copy",
    "ours": "RAM every step + local disk every 10 (default preset), overlapped copy",
    "dcp_best_thread": "dcp.async_save, reused DefaultStager, staging waited before optimizer.step, thread executor; "
    "RAM (tmpfs) every step + local disk every 10",
    "dcp_best_process": "the same, process executor",
    "dcp_own_thread": "dcp.async_save as above, thread executor, at its own best cadence: local disk every 10",
    "dcp_own_process": "the same, process executor",
}


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.1f}%"


def _tail(summary: dict[str, Any]) -> str:
    return "p99" if tail_key(summary) == "p99_s" else "max"


def _where(r: dict[str, Any]) -> str:
    cfg, m = r["config"], r["machine"]
    device = m.get("device") or f"CPU ({m['cpu_count']} cores, {m['cpu_model']})"
    return (
        f"GPT `{cfg['preset']}`: {cfg['params'] / 1e6:.1f}M parameters ({cfg['dtype']}), AdamW, "
        f"{cfg['state_bytes'] / 1e6:.0f} MB of model+optimizer state, batch {cfg['batch_size']} x "
        f"{cfg['model']['seq_len']} tokens, on {device}; torch {m['torch']}, Lightning {m['lightning']}; "
        f"{load_line(m)}"
    )


def _rotation(r: dict[str, Any]) -> list[str]:
    cfg, slow, steps, blocking, rt = r["config"], r["slowdown"], r["step_time"], r["blocking"], r["ratios"]
    drain = r.get("drain") or {}
    rows = []
    for name, s in steps.items():
        sl = slow.get(name, {})
        floor = rt.get(f"{name}_over_floor_mean")
        d = drain.get(name) or {}
        rows.append(
            [
                f"**{name}**" if name.startswith("ours") else name,
                fmt_ms(s["mean_s"]),
                fmt_ms(s["median_s"]),
                f"{fmt_ms(s[tail_key(s)])} ({_tail(s)})",
                _pct(sl.get("mean")) if sl else "",
                _pct(sl.get("p99")) if sl else "",
                fmt_ratio(floor) if floor is not None else "",
                fmt_ms(blocking[name]["mean_s"]) if name in blocking else "",
                fmt_ms(d.get("mean_s")) if name != "none" and d else "",
                _NOTES.get(name, ""),
            ]
        )
    header = ["contender", "mean step", "median", "tail", "slowdown (mean)", "(tail)", "x floor (mean)"]
    header += ["blocking / step", "drain / turn", "what"]
    turns = slow["ours"]["per_turn"]
    best, own = rt["best_dcp"], rt.get("best_dcp_own_cadence")
    floor_line = (
        f"A per-step RAM snapshot (`ours_ram`) slows the step {fmt_ratio(rt.get('ours_ram_over_floor_mean'))} as much "
        f"as the bare copy of the same state (tail: {fmt_ratio(rt.get('ours_ram_over_floor_p99'))}); with the disk "
        f"every 10 (`ours`) {fmt_ratio(rt.get('ours_over_floor_mean'))}. DCP at its best at our cadence is `{best}`: "
        f"it slows the mean step {fmt_ratio(rt['dcp_over_ours_slowdown_mean'])} as much as `ours` (tail: "
        f"{fmt_ratio(rt['dcp_over_ours_slowdown_p99'])}) and blocks the training thread "
        f"{fmt_ratio(rt['dcp_over_ours_blocking_mean'])} as long"
        + (f"; at its own best cadence (`{own}`, the disk every 10 only) {_pct(slow[own]['mean'])}" if own else "")
        + "."
    )
    return [
        "",
        f"Method: one training loop; each contender trains {cfg['turn']} consecutive steps in turn, {cfg['rounds']} "
        f"round(s) (order reversed every other round), after an untimed warm-up turn of {cfg['warmup']} steps each. A "
        "turn's disk save comes on its first step. A step's time runs from its start to the next step's start, so a "
        "wait inside the next step (an optimizer pre-hook) counts against the contender that caused it. A write still "
        f"running after a turn's last step is trained through (at most {cfg.get('tail_steps_max', cfg['turn'])} more "
        "steps, recorded, without a new disk save); what is left is drained and shown apart (*drain / turn*), never "
        "folded into a step. The tail is the p99 from 100 samples up, else the maximum (so named). *x floor* is a "
        "contender's slowdown over the floor's. DCP at its best: one reused `DefaultStager(StagingOptions("
        "use_pinned_memory, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy))` (pinned memory "
        "and non-blocking copies only exist with a GPU), the wait on `staging_completion` in an optimizer pre-hook, "
        "the previous `upload_completion` waited before the next save (torchtitan's `async_with_pinned_mem`), into "
        + ("a tmpfs directory (RAM)" if cfg["dcp_ram_dir_is_tmpfs"] else "a disk directory (no /dev/shm)")
        + " every step and the local disk every 10 steps (our cadence), or the local disk every 10 steps alone (its "
        "own best cadence).",
        "",
        f"{'#' * 3} Step-time slowdown",
        "",
        md_table(header, rows),
        "",
        floor_line
        + " `ours` per turn against the neighbouring `none` turn: "
        + (f"{min(turns) * 100:+.1f}% to {max(turns) * 100:+.1f}%" if turns else "n/a")
        + " (the machine's drift). *Blocking* is the training thread's own time in the checkpoint calls and hooks; "
        "the slowdown also holds what the background copy and writes take from the training thread's cores.",
    ]


def _lightning(pl: dict[str, Any], sub: str) -> list[str]:
    rows = []
    for kind, mean in pl["mean_step_with_drain_s"].items():
        si = pl["step_interval"][kind]
        rows.append(
            [
                kind,
                fmt_ms(mean),
                fmt_ms(si["median_s"]),
                f"{fmt_ms(si[tail_key(si)])} ({_tail(si)})",
                _pct(pl["slowdown"].get(kind)) if kind != "none" else "",
                LIGHTNING_KINDS.get(kind, ""),
            ]
        )
    return [
        "",
        f"{sub} Through Lightning",
        "",
        "`TieredCheckpoint` against `ModelCheckpoint` + `AsyncCheckpointIO` at our cadence and at its own best one, "
        "and a Trainer without checkpointing, Trainer runs in alternating order. The mean step runs from the first "
        "measured step to the end of `fit`, so the drain of queued saves after the last step is counted.",
        "",
        md_table(
            ["Trainer", "mean step (drain counted)", "median interval", "tail interval", "slowdown", "what"], rows
        ),
    ]


def render_markdown(r: dict[str, Any], *, heading: str = "##") -> str:
    cfg, sub = r["config"], heading + "#"
    out = [f"{heading} {TITLE}", "", _where(r) + ".", ""]
    out.append(
        f"*Command:* `{r['command']}` · *Date:* {r['date']} · *Run time:* {r['total_wall_s'] / 60:.1f} min"
        + (" · **quick (smoke) run: not a figure to publish**" if cfg["quick"] else "")
    )
    out += _rotation(r)
    pl = r.get("lightning") or {}
    if pl:
        out += _lightning(pl, sub)
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
            "**CPU only.** On this machine the background copy and the disk write share the cores with training, so "
            "the slowdown above holds that competition. On a GPU the snapshot is a device-to-host copy on a side "
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
    """The README line of this benchmark (generated; a test checks the README holds it): the floor ratio first."""
    cfg, slow, rt, rs = r["config"], r["slowdown"], r["ratios"], r["restore"]
    best, own = rt["best_dcp"], rt.get("best_dcp_own_cadence")
    tail = slow["ours_ram"].get("tail", "p99")
    device = r["machine"].get("device") or "CPU"
    text = (
        f"**checkpoint every step** ({cfg['params'] / 1e6:.0f}M-parameter GPT + AdamW, "
        f"{cfg['state_bytes'] / 1e6:.0f} MB of state, {device}): a per-step RAM snapshot costs "
        f"{fmt_ratio(rt.get('ours_ram_over_floor_mean'))} the bare copy of the state (the floor) in step-time "
        f"slowdown, mean ({fmt_ratio(rt.get('ours_ram_over_floor_p99'))} {tail}): {_pct(slow['ours_ram']['mean'])} "
        f"against {_pct(slow['floor']['mean'])}; with the local disk every 10, {_pct(slow['ours']['mean'])} mean "
        f"({_pct(slow['ours']['p99'])} {tail}); PyTorch DCP at its best at the same cadence (`async_save`, reused "
        f"stager, {best.removeprefix('dcp_best_')} executor) {_pct(slow[best]['mean'])} "
        f"({fmt_ratio(rt['dcp_over_ours_slowdown_mean'])} ours)"
        + (f", at its own best cadence (disk every 10) {_pct(slow[own]['mean'])}" if own else "")
    )
    pl = r.get("lightning") or {}
    if pl:
        sl = pl["slowdown"]
        text += (
            f"; through Lightning `TieredCheckpoint` {_pct(sl['tiered'])} against {_pct(sl['modelcheckpoint_same'])} "
            f"for `ModelCheckpoint` + `AsyncCheckpointIO` at the same cadence and {_pct(sl['modelcheckpoint_best'])} "
            "at its own (disk every 10; drain counted)"
        )
    text += (
        f"; a restore from RAM, `load_state_dict` included, takes {fmt_ms(rs['ours_ram']['total']['median_s'])}, "
        f"{fmt_ratio(rt['restore_disk_warm_over_ram'])} faster than from a warm local disk."
    )
    return text
