"""What does SDC verification catch at the cadence users run it, how fast, and what does it cost there?

Run from the repository root::

    python -m benchmarks.sdc_coverage            # 4 flips per location x bit class, both presets, ~12 minutes
    python -m benchmarks.sdc_coverage --quick    # smoke mode: short cadences, 1 flip per cell (not a figure)

Three CPU processes train ``recipes._gpt.TinyGPT`` (tiny preset) under DDP on gloo with a plain loop and an
:class:`~lightning_resilience.sdc.SDCMonitor` configured exactly as a preset (``configs/resilience/sdc``):

* ``default`` (``resilience=default``, ``sdc/guards.yaml``): guards every step, read one step late; cross-replica
  reconciliation every 50 steps; no scheduled replay;
* ``full`` (``resilience=full``, ``sdc/dual_run.yaml``): the same guards, a dual-run replay (with partner) every 50
  steps, reconciliation every 25.

Each trial restarts from the same initial state, trains ``2 x W`` steps (W = the preset's longest cadence: the first
W warm the guard baselines) and flips one bit on a random rank at a random step of the second window (a parameter,
a local gradient before the all-reduce, an AdamW state tensor, or a leaf module's activation; sign, exponent,
high-mantissa or low-mantissa bit). Outcomes:

* ``caught``: a corruption verdict naming exactly the injected rank;
* ``flagged``: something was detected (a guard anomaly, a rollback request, a verdict naming other ranks) but the
  rank was not named;
* ``missed``: nothing detected, and the final state differs bitwise from the clean run;
* ``no_effect``: nothing detected and the final state is bitwise equal to the clean run.

Coverage = caught / (trials - no_effect); detection = (caught + flagged) / (trials - no_effect). A "faulty device"
row makes one rank corrupt every gradient of one weight from the flip step on.

Overhead, same ranks, same preset: windows of W steps with the monitor alternate with windows without it (A B B A),
so every monitored window holds exactly the checks of one cadence period; the slowdown is the ratio of the mean step
times (p99 too). Latency is in optimizer steps from the corrupt step to the first event.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import (
    REPO_ROOT,
    add_load_argument,
    check_load_at_start,
    command_line,
    finish_load,
    fmt_pct,
    machine_info,
    md_table,
    now_iso,
    percentile,
    print_flush,
    target,
    write_json,
)
from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.sdc.fingerprint import BitwiseDigest, digest_all
from lightning_resilience.sdc.guards import Guards
from lightning_resilience.sdc.inject import BIT_CLASSES, LOCATIONS, BitFlipInjector, FlipSpec
from lightning_resilience.sdc.monitor import SDCMonitor
from lightning_resilience.sdc.verdict import Diagnosis

MODULE = "benchmarks.sdc_coverage"
DEFAULT_OUT = "benchmarks/results/sdc_coverage.json"
TITLE = "SDC verification at the presets' cadence: coverage of random bit flips, latency and step-time overhead"
WORLD = 3
PRESETS = {"default": "guards", "full": "dual_run"}
"""Preset name -> its file in configs/resilience/sdc/."""

pc = time.perf_counter


def preset_config(name: str, scale: int | None = None) -> SDCConfig:
    """The SDC config a preset builds (its YAML's ``config:``); ``scale`` shortens every cadence to that many steps
    (quick runs only)."""
    from omegaconf import OmegaConf

    node = OmegaConf.load(REPO_ROOT / "configs" / "resilience" / "sdc" / f"{PRESETS[name]}.yaml")
    values = {k: v for k, v in OmegaConf.to_container(node.config).items() if k != "run_dir"}  # type: ignore[union-attr]
    if scale is not None:
        for key in ("replay_every_n_steps", "reconcile_every_n_steps"):
            if values.get(key):
                values[key] = scale
    return SDCConfig(**values)


def window(cfg: SDCConfig) -> int:
    return max(cfg.replay_every_n_steps, cfg.reconcile_every_n_steps, cfg.param_norm_every_n_steps)


def _model_kwargs() -> dict[str, Any]:
    from recipes._gpt import gpt_preset

    kw = gpt_preset("tiny")
    kw["max_steps"] = 1000
    return kw


def _batches(kw: dict[str, Any], rank: int, n: int, batch_size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(kw["vocab_size"], (batch_size, kw["seq_len"] + 1), generator=gen) for _ in range(n)]


def _loss(module: Any, batch: torch.Tensor) -> torch.Tensor:
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = module(inputs)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _trials(args: argparse.Namespace, w: int) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    out = []
    for location in args.locations:
        for bit_class in BIT_CLASSES:
            for _ in range(args.flips_per_cell):
                out.append(dict(kind="flip", location=location, bit_class=bit_class, rank=rng.randrange(WORLD),
                                step=w + rng.randrange(w), seed=rng.randrange(2**31)))  # fmt: skip
    for _ in range(args.faulty_trials):
        out.append(dict(kind="faulty", location="grad", bit_class="exponent", rank=rng.randrange(WORLD),
                        step=w + rng.randrange(w), seed=rng.randrange(2**31)))  # fmt: skip
    return out


def _rank(rank: int, preset: str, scale: int | None, trials: list[dict[str, Any]], overhead_rounds: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from recipes._gpt import TinyGPT

    torch.use_deterministic_algorithms(True)
    cfg = preset_config(preset, scale)
    w = window(cfg)
    kw = _model_kwargs()
    torch.manual_seed(0)
    model = TinyGPT(**kw)
    model.train()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ddp = DistributedDataParallel(model)
    batches = _batches(kw, rank, 2 * w, 4)
    monitor = SDCMonitor(list(model.named_parameters()), [], cfg)
    monitor.setup()
    monitor.attach(lambda b: _loss(model, b), ddp=ddp, synced_loss_fn=lambda b: _loss(ddp, b))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(i: int, checked: bool) -> float:
        batch = batches[i % len(batches)]
        t0 = pc()
        if checked:
            monitor.begin_step(i, batch)
        loss = _loss(ddp, batch)
        if checked:
            monitor.observe_loss(loss)
        loss.backward()
        if checked:
            monitor.before_optimizer_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if checked:
            monitor.after_optimizer_step()
        return pc() - t0

    def reset() -> None:
        nonlocal opt
        with torch.no_grad():
            model.load_state_dict(init)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        monitor.optimizers = monitor.reconciler.optimizers = [opt]
        monitor.reset()
        # fresh baselines: every trial replays the same steps, a baseline fed by earlier trials would be noise
        monitor.guards = Guards(cfg.guard_window, cfg.guard_min_history, cfg.guard_threshold)
        monitor.reader.guards = monitor.guards
        torch.manual_seed(100 + rank)

    def run(trial: dict[str, Any] | None) -> dict[str, Any]:
        reset()
        injector = BitFlipInjector(model, [opt], rank=rank)
        plan = []
        if trial is not None and trial["kind"] == "flip":
            plan = [FlipSpec(trial["location"], trial["step"], trial["rank"], trial["bit_class"], seed=trial["seed"])]
        for i in range(2 * w):
            if trial is not None and trial["kind"] == "faulty" and i == trial["step"] and rank == trial["rank"]:
                injector.faulty_device("grad", 1, bit_class="exponent", seed=trial["seed"])
            injector.on_step(i, plan)
            step(i, True)
            if monitor.dirty:  # a rollback was asked for: the trial is decided
                break
        injector.remove()
        final = digest_all(BitwiseDigest(), [p.detach() for p in model.parameters()])
        events = [e.to_json() for e in monitor.events if e.verdict is not Diagnosis.CLEAN]
        return {"final": final.tolist(), "events": events}

    run(None)  # DDP rebuilds its buckets after the first iteration: the reference must use the final layout
    reference = run(None)
    results = []
    for trial in trials:
        r = run(trial)
        r["effect"] = r["final"] != reference["final"]
        del r["final"]
        results.append(r)
    # overhead: windows of w steps with and without the monitor, A B B A, from a warm state
    reset()
    for i in range(w):
        step(i, True)
    times: dict[str, list[float]] = {"plain": [], "checked": []}
    i = w
    for r in range(overhead_rounds):
        for kind in ("checked", "plain") if r % 2 == 0 else ("plain", "checked"):
            for _ in range(w):
                times[kind].append(step(i, kind == "checked"))
                i += 1
    return {"results": results if rank == 0 else [], "times": times, "window": w, "events": reference["events"]}


def _classify(trial: dict[str, Any], res: dict[str, Any]) -> str:
    if res["events"]:
        corrupt = [e for e in res["events"] if e["verdict"] not in ("clean", "anomaly")]
        suspects = sorted({s for e in corrupt for s in e["suspects"]})
        return "caught" if corrupt and suspects == [trial["rank"]] else "flagged"
    return "missed" if res["effect"] else "no_effect"


def measure(preset: str, args: argparse.Namespace) -> dict[str, Any]:
    from tests.sdc._spawn import run_ranks

    cfg = preset_config(preset, args.scale)
    w = window(cfg)
    trials = _trials(args, w)
    print_flush(f"[sdc] {preset}: {len(trials)} trials of {2 * w} steps on {WORLD} ranks")
    t0 = pc()
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        per_rank = run_ranks(_rank, WORLD, Path(tmp), preset, args.scale, trials, args.overhead_rounds,
                             timeout_s=7200.0)  # fmt: skip
    results = per_rank[0]["results"]
    cells: dict[str, dict[str, Any]] = {}
    for trial, res in zip(trials, results):
        key = "faulty_device" if trial["kind"] == "faulty" else f"{trial['location']}/{trial['bit_class']}"
        cell = cells.setdefault(key, {"trials": 0, "caught": 0, "flagged": 0, "missed": 0, "no_effect": 0,
                                      "latencies": []})  # fmt: skip
        cell["trials"] += 1
        outcome = _classify(trial, res)
        cell[outcome] += 1
        if outcome in ("caught", "flagged"):
            cell["latencies"].append(min(e["step"] for e in res["events"]) - (trial["step"] + 1))
    for cell in cells.values():
        effective = cell["trials"] - cell["no_effect"]
        cell["coverage"] = cell["caught"] / effective if effective else None
        cell["detection"] = (cell["caught"] + cell["flagged"]) / effective if effective else None
        lat = cell.pop("latencies")
        cell["latency_steps_mean"] = statistics.fmean(lat) if lat else None
        cell["latency_steps_max"] = max(lat) if lat else None
    times = per_rank[0]["times"]
    plain, checked = times["plain"], times["checked"]
    return {
        "preset": preset,
        "config": {
            k: getattr(cfg, k)
            for k in (
                "guards",
                "guard_read_lag",
                "replay_every_n_steps",
                "partner_replay",
                "reconcile_every_n_steps",
                "param_norm_every_n_steps",
            )
        },
        "window_steps": w,
        "trial_steps": 2 * w,
        "cells": cells,
        "totals": _totals(cells),
        "clean_run_events": per_rank[0]["events"],
        "overhead": {
            "plain_step_mean_s": statistics.fmean(plain),
            "checked_step_mean_s": statistics.fmean(checked),
            "slowdown_mean": statistics.fmean(checked) / statistics.fmean(plain) - 1.0,
            "slowdown_median": statistics.median(checked) / statistics.median(plain) - 1.0,
            "slowdown_p99": (percentile(checked, 99) or 0.0) / (percentile(plain, 99) or 1.0) - 1.0,
            "steps_each": len(plain),
        },
        "wall_s": pc() - t0,
    }


def _totals(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def rate(keys: Sequence[str], num: Sequence[str]) -> float | None:
        eff = sum(cells[k]["trials"] - cells[k]["no_effect"] for k in keys if k in cells)
        got = sum(cells[k][n] for k in keys if k in cells for n in num)
        return got / eff if eff else None

    flips = [k for k in cells if k != "faulty_device"]
    high = [k for k in flips if k.endswith(("/sign", "/exponent"))]
    return {
        "sign_exponent_coverage": rate(high, ["caught"]),
        "sign_exponent_detection": rate(high, ["caught", "flagged"]),
        "all_flips_coverage": rate(flips, ["caught"]),
        "all_flips_detection": rate(flips, ["caught", "flagged"]),
        "faulty_device_coverage": rate(["faulty_device"], ["caught"]),
    }


def render_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"## {TITLE}",
        "",
        f"*Command:* `{result['command']}` · *Date:* {result['date']} · {WORLD} CPU ranks (gloo), tiny GPT"
        + (" · **quick (smoke) run: shortened cadences, not a figure**" if result["config"]["quick"] else ""),
        "",
        "Each preset's monitor exactly as `configs/resilience/sdc/` builds it; a flip lands at a random step of a "
        "cadence period after the guards are warm. *caught*: a verdict naming the injected rank; *flagged*: detected "
        "but not located (a guard anomaly, a rollback request, other ranks named); *coverage* = caught / (trials - "
        "no effect), *detection* = (caught + flagged) / (trials - no effect).",
        "",
    ]
    for name, p in result["presets"].items():
        c, o, t = p["config"], p["overhead"], p["totals"]
        rows = [[k, v["trials"], v["caught"], v["flagged"], v["missed"], v["no_effect"], fmt_pct(v["coverage"]),
                 fmt_pct(v["detection"]), _num(v["latency_steps_mean"])] for k, v in p["cells"].items()]  # fmt: skip
        lines += [
            f"### Preset `{name}`: guards (read lag {c['guard_read_lag']}), replay every "
            f"{c['replay_every_n_steps'] or 'never'}, reconciliation every {c['reconcile_every_n_steps']}",
            "",
            md_table(
                [
                    "location/bit",
                    "trials",
                    "caught",
                    "flagged",
                    "missed",
                    "no effect",
                    "coverage",
                    "detection",
                    "latency (steps)",
                ],
                rows,
            ),
            "",
            f"Sign/exponent flips: coverage {fmt_pct(t['sign_exponent_coverage'])}, detection "
            f"{fmt_pct(t['sign_exponent_detection'])}; all flips: coverage {fmt_pct(t['all_flips_coverage'])}, "
            f"detection {fmt_pct(t['all_flips_detection'])}. Step-time overhead at this cadence ({o['steps_each']} "
            f"steps each way, interleaved windows of {p['window_steps']}): mean {fmt_pct(o['slowdown_mean'])}, median "
            f"{fmt_pct(o['slowdown_median'])}, p99 {fmt_pct(o['slowdown_p99'])}.",
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


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def readme_summary(result: dict[str, Any]) -> str:
    parts = []
    for name, p in result["presets"].items():
        c, t = p["config"], p["totals"]
        checks = f"reconciliation every {c['reconcile_every_n_steps']}" + (
            f", replay every {c['replay_every_n_steps']}" if c["replay_every_n_steps"] else ""
        )
        parts.append(
            f"`resilience={name}` (guards, {checks}) detects {fmt_pct(t['sign_exponent_detection'])} of sign/exponent "
            f"flips and names the rank for {fmt_pct(t['sign_exponent_coverage'])}, at "
            f"{fmt_pct(p['overhead']['slowdown_mean'])} mean step time"
        )
    return "**SDC** (random bit flips on 3 DDP ranks, at the presets' cadence): " + "; ".join(parts) + "."


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--preset", action="append", choices=list(PRESETS), default=None, help="preset(s) to measure")
    p.add_argument("--flips-per-cell", type=int, default=None, help="flips per location x bit class (4; quick: 1)")
    p.add_argument("--faulty-trials", type=int, default=None, help="faulty-device trials (4; quick: 1)")
    p.add_argument("--overhead-rounds", type=int, default=None, help="window pairs for the overhead (6; quick: 2)")
    p.add_argument("--locations", nargs="+", choices=LOCATIONS, default=list(LOCATIONS), help="where bits flip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmpdir", default=None, help="where the ranks leave their results")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    p.add_argument("--quick", action="store_true", help="smoke mode: cadences shortened to 5 steps, few trials")
    add_load_argument(p)
    args = p.parse_args(argv)
    q = args.quick
    args.preset = args.preset or list(PRESETS)
    args.flips_per_cell = args.flips_per_cell or (1 if q else 4)
    args.faulty_trials = args.faulty_trials if args.faulty_trials is not None else (1 if q else 4)
    args.overhead_rounds = args.overhead_rounds or (2 if q else 6)
    args.scale = 5 if q else None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(1)
    t0 = pc()
    machine = machine_info()
    check_load_at_start(machine, allow=args.allow_loaded, quick=args.quick, name=MODULE)
    presets = {name: measure(name, args) for name in args.preset}
    targets = []
    if "default" in presets:
        d = presets["default"]
        targets += [
            target(
                "default preset: sign/exponent flips detected",
                d["totals"]["sign_exponent_detection"],
                ">=",
                0.7,
                note="EUD ~70% recall",
            ),
            target("default preset: step-time overhead (mean)", d["overhead"]["slowdown_mean"], "<=", 0.01),
        ]
    if "full" in presets:
        f = presets["full"]
        targets += [
            target(
                "full preset: sign/exponent flips caught and located", f["totals"]["sign_exponent_coverage"], ">=", 0.99
            ),
            target("full preset: step-time overhead (mean)", f["overhead"]["slowdown_mean"], "<=", 0.02),
        ]
    result: dict[str, Any] = {
        "benchmark": MODULE,
        "title": TITLE,
        "command": command_line(MODULE, argv),
        "date": now_iso(),
        "machine": finish_load(machine),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "tmpdir")},
        "presets": presets,
        "targets": targets,
        "notes": [
            "Measured at the cadence the presets run, not with every check every step: a gradient or activation flip "
            "is found only when a guard fires (its values read one step late, after the update) or when it falls on "
            "a replay step; a parameter or optimizer-state flip persists and is found at the next reconciliation.",
            "A guard read late cannot name a rank or undo the update: it asks for a replay of the next step, and a "
            "non-finite value asks for a rollback to a verified checkpoint (counted as flagged).",
            "CPU timings of a small model: on a GPU the guards and digests are device work that the step does not "
            "wait for, and a replay costs the same fraction of a step as here.",
        ],
        "wall_s": pc() - t0,
    }
    out = write_json(args.out, result)
    print_flush(render_markdown(result))
    print_flush(f"\nwrote {out} in {pc() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
