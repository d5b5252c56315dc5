"""What does SDC verification catch at the cadence users run it, how fast, and what does it cost there?

Run from the repository root::

    python -m benchmarks.sdc_coverage            # 20 trials per cell, both presets (about an hour, quiet machine)
    python -m benchmarks.sdc_coverage --quick    # smoke mode: short cadences, 1 trial per cell (not a figure)

Three CPU processes train ``recipes._gpt.TinyGPT`` (tiny preset) under DDP on gloo with a plain loop, an
:class:`~lightning_resilience.sdc.SDCMonitor` configured exactly as a preset (``configs/resilience/sdc``) and the
suite's :class:`~lightning_resilience.step.driver.StepDriver`: the late guards travel in each step's one agreement,
issued at the step's start and taken at its end, as in a Lightning job (no rank waits on an ordinary step).

* ``default`` (``resilience=default``, ``sdc/guards.yaml``): guards every step, read one step late; cross-replica
  reconciliation every 50 steps; a replay on every device every 200 steps (every other rank's batch, by that rank
  and its neighbour); no communication hook; the same round when a job-wide guard fires (of the spiking ranks'
  batches when only losses spike; none for a spike within ``guard_quiet_steps`` of one a replay found genuine), and
  of every batch at the first step after a rollback;
* ``full`` (``resilience=full``, ``sdc/dual_run.yaml``): the same guards, a dual-run replay (with partner, bucket
  digests by a communication hook) every 50 steps, reconciliation every 25.

Faults, reported apart (20 trials per cell by default, each from the same initial state, ``2 x W`` steps where W is
the longest cadence of the checks a flip that stays waits for, :func:`window`; the fault lands at a random step of
the second window, after the guard baselines are warm):

* **persistent state** — a parameter or an AdamW state tensor: one bit (any class), a burst of 3 adjacent bits, or
  one bit in 4 elements 7 apart (strided). It stays until a reconciliation sees it.
* **transient** — a local gradient before the all-reduce or a leaf module's activation, the same three patterns,
  once. Only a guard (its values read one step late: it asks for a replay of the *next* step) or a replay of that
  very step can see it; the ``caught by`` column says which.
* **faulty device** — one rank corrupts one weight's gradient from the fault step on: an exponent bit at every
  step, or a low mantissa bit at every step; a **flaky device**: an exponent bit at a rate of 1 in 4 (reported
  apart, no goal). A faulty-device trial runs for the stated bound after its onset (:func:`faulty_bound`: the steps
  within which the preset's scheduled replays meet every rank), so a miss is a miss of the bound, not of the window.
* **stale save** — a checkpoint tier commits the previous step's tensors under a new step's name (single process,
  :class:`~lightning_resilience.checkpoint.manager.CheckpointManager` with a local tier): is it refused at the
  restore, and is the step before it restored?

Outcomes: ``caught`` (a corruption verdict naming exactly the faulty rank), ``flagged`` (detected, no rank or
another rank named: an inconclusive vote, a rollback for a non-finite value), ``missed`` (nothing detected, the final
state differs bitwise from the clean run), ``no_effect`` (nothing detected, state equal to the clean run). Coverage =
caught / (trials - no effect) with its 95% Wilson interval; localization = caught / (caught + flagged); latency in
optimizer steps from the faulty step to the first detection (mean, max).

Overhead, in the same run: windows of 10 steps (``--overhead-window``) of the preset's monitored loop, 160 of them
(``--overhead-rounds``), alternate (A B B A) with as many windows of a
**true plain arm**: a second replica of the model with its own DDP wrapper that has no communication hook, no
digests, no guards and no step driver. Each arm keeps its own state, so nothing a check leaves behind (a hook
enabled, digests on) runs in a plain window. Slowdown = mean and p99 step time of the monitored arm over the plain,
and the mean over neighbouring pairs of windows with its 95% interval (the drift between two windows cancels).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import (
    add_load_argument,
    check_load_at_start,
    command_line,
    cpu_counters,
    finish_load,
    machine_info,
    now_iso,
    print_flush,
    target,
    write_json,
)
from benchmarks._sdc.rank import run_rank
from benchmarks._sdc.render import OVERHEADS, TITLE, readme_summary, render_markdown, where
from benchmarks._sdc.tally import cells_of, kinds_of, overhead_of, stale_saves
from benchmarks._sdc.trials import (
    FAULTY,
    LOCATION_KIND,
    OVERHEAD_BATCH,
    OWN_CORES,
    PRESETS,
    WORLD,
    faulty_bound,
    make_trials,
    model_kwargs,
    preset_config,
    wilson,
    window,
)

__all__ = ["DEFAULT_OUT", "README_PENDING", "TITLE", "main", "readme_summary", "render_markdown", "wilson"]

MODULE = "benchmarks.sdc_coverage"
DEFAULT_OUT = "benchmarks/results/sdc_coverage.json"
README_PENDING = (
    "**SDC** (persistent-state flips, transient flips and faulty devices apart, 3 DDP ranks, the presets' cadence): "
    "pending, no result of the current benchmark yet (`python -m benchmarks.sdc_coverage` on a quiet machine)."
)

pc = time.perf_counter


def measure(preset: str, args: argparse.Namespace) -> dict[str, Any]:
    from tests.sdc._spawn import run_ranks

    cfg = preset_config(preset, args.scale)
    w = window(cfg)
    trials = make_trials(args, w)
    print_flush(f"[sdc] {preset}: {len(trials)} trials of {2 * w} steps on {WORLD} ranks")
    t0 = pc()
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        # each launch reads only what it wrote
        first, second, third = Path(tmp) / "trials", Path(tmp) / "own_cores", Path(tmp) / "large_batch"
        for folder in (first, second, third):
            folder.mkdir()
        per_rank = run_ranks(run_rank, WORLD, first, preset, args.scale, trials, args.overhead_rounds,
                             args.overhead_window, timeout_s=14400.0)  # fmt: skip
        print_flush(f"[sdc] {preset}: the overhead again on {OWN_CORES} ranks, one per core")
        own = run_ranks(run_rank, OWN_CORES, second, preset, args.scale, None, args.overhead_rounds,
                        args.overhead_window, timeout_s=3600.0)  # fmt: skip
        print_flush(f"[sdc] {preset}: the overhead again on {OWN_CORES} ranks, batches of {args.overhead_batch}")
        large = run_ranks(run_rank, OWN_CORES, third, preset, args.scale, None, args.overhead_rounds,
                          args.overhead_window, args.overhead_batch, timeout_s=3600.0)  # fmt: skip
    cells = cells_of(trials, per_rank[0]["results"])
    return {
        "preset": preset,
        "config": {
            k: getattr(cfg, k)
            for k in (
                "guards",
                "guard_read_lag",
                "guard_threshold",
                "guard_quiet_steps",
                "replay_every_n_steps",
                "partner_replay",
                "replay_scope",
                "reconcile_every_n_steps",
                "param_norm_every_n_steps",
                "ddp_fingerprint",
            )
        },
        "window_steps": w,
        "trial_steps": 2 * w,
        "faulty_bound_steps": faulty_bound(cfg),
        "cells": cells,
        "kinds": kinds_of(cells),
        "clean_run_events": per_rank[0]["events"],
        "overhead": {**overhead_of(per_rank), "tokens_per_step": 4 * model_kwargs()["seq_len"]},
        "overhead_own_cores": {**overhead_of(own), "tokens_per_step": 4 * model_kwargs()["seq_len"]},
        "overhead_large_batch": {
            **overhead_of(large),
            "batch": args.overhead_batch,
            "tokens_per_step": args.overhead_batch * model_kwargs()["seq_len"],
        },
        "ranks_cpu_s": sum(r["cpu_s"] for r in [*per_rank, *own, *large]),
        "wall_s": pc() - t0,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--preset", action="append", choices=list(PRESETS), default=None, help="preset(s) to measure")
    p.add_argument("--trials", type=int, default=None, help="trials per cell (20; quick: 1)")
    p.add_argument("--overhead-rounds", type=int, default=None, help="window pairs for the overhead (160; quick: 4)")
    p.add_argument("--overhead-window", type=int, default=None, help="steps per overhead window (10; quick: 5)")
    p.add_argument("--overhead-batch", type=int, default=OVERHEAD_BATCH,
                   help=f"batch of the third overhead launch ({OVERHEAD_BATCH}; the trials' is 4)")  # fmt: skip
    p.add_argument("--locations", nargs="+", choices=list(LOCATION_KIND), default=list(LOCATION_KIND),
                   help="where bits flip")  # fmt: skip
    p.add_argument("--faulty", nargs="*", choices=list(FAULTY), default=list(FAULTY), help="faulty-device kinds")
    p.add_argument("--stale-trials", type=int, default=None, help="stale-save trials (20; quick: 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmpdir", default=None, help="where the ranks leave their results")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    p.add_argument("--quick", action="store_true", help="smoke mode: cadences shortened to 5 steps, few trials")
    add_load_argument(p)
    args = p.parse_args(argv)
    q = args.quick
    args.preset = args.preset or list(PRESETS)
    args.trials = args.trials if args.trials is not None else (1 if q else 20)
    args.overhead_rounds = args.overhead_rounds or (4 if q else 160)
    args.overhead_window = args.overhead_window or (5 if q else 10)
    args.stale_trials = args.stale_trials if args.stale_trials is not None else (2 if q else 20)
    args.scale = 5 if q else None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(1)
    t0 = pc()
    machine = machine_info()
    check_load_at_start(machine, allow=args.allow_loaded, quick=args.quick, name=MODULE)
    since = cpu_counters()  # its 3 ranks load the machine themselves: the end is judged by others' CPU time
    presets = {name: measure(name, args) for name in args.preset}
    stale = stale_saves(args.stale_trials, args.seed) if args.stale_trials else None
    targets = []
    if "default" in presets:
        d = presets["default"]["kinds"]
        for kind in ("persistent", "faulty_device"):
            if kind in d:
                targets.append(target(f"default preset: {kind.replace('_', ' ')} faults caught and named",
                                      d[kind]["coverage"], ">=", 0.99, unit="fraction"))  # fmt: skip
        bound = presets["default"]["faulty_bound_steps"]
        if "faulty_device" in d and bound is not None and d["faulty_device"]["latency_steps_max"] is not None:
            targets.append(target("default preset: faulty device (every step) detected within the stated bound",
                                  d["faulty_device"]["latency_steps_max"], "<=", bound, unit="steps"))  # fmt: skip
        for key, _ in OVERHEADS:
            o = presets["default"][key]
            targets.append(target(f"default preset: step-time overhead (mean), {where(key, o)}", o["slowdown_mean"],
                                  "<=", 0.02, unit="fraction"))  # fmt: skip
    if "full" in presets:
        for key, _ in OVERHEADS:
            o = presets["full"][key]
            targets.append(target(f"full preset: step-time overhead (mean), {where(key, o)}", o["slowdown_mean"],
                                  "<=", 0.05, unit="fraction"))  # fmt: skip
    if stale is not None:
        targets.append(target("stale saves refused at the restore", stale["coverage"], ">=", 0.99, unit="fraction"))
    result: dict[str, Any] = {
        "benchmark": MODULE,
        "title": TITLE,
        "command": command_line(MODULE, argv),
        "date": now_iso(),
        "machine": finish_load(machine, since, own_extra_s=sum(p["ranks_cpu_s"] for p in presets.values())),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "tmpdir")},
        "presets": presets,
        "stale_saves": stale,
        "targets": targets,
        "notes": [
            "Measured at the cadence the presets run, not with every check every step. A parameter or optimizer-state "
            "flip persists and is found at the next reconciliation, which names the rank with three replicas (two "
            "replicas are inconclusive: the state is rejected, no rank named).",
            "A transient flip (a gradient or an activation, once) is seen only by a guard, read one step late (it asks "
            "for a replay of the next step, which cannot see a fault that did not recur; a non-finite value asks for "
            "a rollback), or by a replay of that very step (the full preset's schedule): the caught-by column says "
            "which.",
            "A transient flip lands on a scheduled replay with probability 1 / replay_every_n_steps. Where that "
            "cadence is more than twice the trials' window (the default preset: a replay every 200 steps, a window "
            "of 50), the trials do not sample it: the transient figures leave out that 0.5%.",
            "A faulty device corrupts the replays on its rank too: a replay asked for by a guard, the replay of the "
            "first step after the rollback its non-finite values ask for, or a scheduled one (the default preset's "
            "rounds have every device replay once, its own batch or its neighbour's) names it by a majority of the "
            "three ranks.",
            "A flaky device (corrupting 1 step in 4) is met by the same replays, each of which sees the fault only at "
            "that rate: it is reported apart (flaky_device), without a goal.",
            "CPU timings of a small model: on a GPU the guards and digests are device work that the step does not "
            "wait for, and a replay costs the same fraction of a step as here.",
            f"The overhead is measured three times, each against its own plain arm: on the {WORLD} ranks of the "
            f"trials ({WORLD} processes and their agreement threads on 2 cores: a rank whose thread is woken can lose "
            f"its core for a scheduler slice, which the driver's issue phase shows), and on {OWN_CORES} ranks, one "
            "per core, as a job runs one rank per device, with the trials' batches (256 tokens a step per rank) and "
            f"with batches of {args.overhead_batch} sequences. The guards, the reconciliation and the driver cost "
            "about the same time a step at any batch (their work follows the parameters, not the tokens), and a "
            "replay costs the same fraction of a step: with more tokens a step, as a real job has (thousands a rank), "
            "the fixed part is a smaller share. All three are held to the goal.",
        ],
        "wall_s": pc() - t0,
    }
    out = write_json(args.out, result)
    print_flush(render_markdown(result))
    print_flush(f"\nwrote {out} in {pc() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
