"""What does the budget's cadence buy at scale? ETTR of the budgeted default against fixed cadences, in the simulator,
with checkpoint costs measured on this machine by the engine itself.

Run from the repository root, on a quiet machine::

    python -m benchmarks.cadence_ettr                    # measure the costs (small GPT), then simulate; ~5 min
    python -m benchmarks.cadence_ettr --quick --preset tiny   # smoke mode: seconds; nothing to publish

First the checkpoint engine runs a plain training loop with both tiers left to the budget (``MemoryTier(0)``,
``LocalTier(0)``) and reports what it measured: the step time, what a snapshot blocks, what a persist adds, the write
time; a fresh engine then restores from the disk (timed, ``load_state_dict`` excluded). The simulator takes these
costs as they are (the step time too) for a RAM tier (lost with its process) and a disk tier taken as durable shared
storage at the measured write cost, and simulates a job of ``--days`` days at a job MTBF of 1 h and 8 h measured at
1,024 ranks (Kokolis et al.'s way: the failure rate grows with the ranks), at 1,024 and 16,384 ranks, with the
simulator's default failure mix and restart costs; the disk tier keeps the checkpoints of the SDC detection window
(an hour in that mix). Cadences compared: both chosen by the budget (the simulator
calls the engine's own cadence function with the job MTBF at that scale), and fixed: RAM every step with the disk
every 10 (the default preset), 100 or 1,000 steps.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import (
    add_load_argument,
    check_load_at_start,
    fmt_ms,
    load_line,
    machine_info,
    md_table,
    print_flush,
    report,
    result_header,
    target,
)
from benchmarks._workload import GPTWorkload
from lightning_resilience.checkpoint.cadence import BUDGET
from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.sim.config import (
    DAY,
    HOUR,
    ClusterConfig,
    Durability,
    FailureConfig,
    JobConfig,
    SimConfig,
    SimTierConfig,
    default_failure_kinds,
)
from lightning_resilience.sim.engine import simulate_many

__all__ = ["DEFAULT_OUT", "README_PENDING", "TITLE", "main", "readme_summary", "render_markdown"]

MODULE = "benchmarks.cadence_ettr"
DEFAULT_OUT = "benchmarks/results/cadence_ettr.json"
TITLE = "Checkpoint cadence at scale: ETTR of the budgeted default against fixed cadences (simulated, measured costs)"
README_PENDING = (
    "**checkpoint cadence at scale** (ETTR of the budgeted default against fixed cadences, simulated with measured "
    "costs): pending a run on a quiet machine (`python -m benchmarks.cadence_ettr`)."
)
MTBF_H = (1.0, 8.0)
RANKS = (1024, 16384)
FIXED = {"preset (RAM 1, disk 10)": (1, 10), "RAM 1, disk 100": (1, 100), "RAM 1, disk 1000": (1, 1000)}
BUDGETED = "budget (both chosen)"
SDC_WINDOW_S = max(k.detection_s for k in default_failure_kinds() if k.name == "sdc")
"""How late the simulator's failure mix finds an SDC: the durable tier keeps this much training (see ``_config``)."""
TOLERANCE = 0.005
"""The budgeted cadence's ETTR within half a point of the best fixed one."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--preset", choices=["tiny", "small"], default="small", help="model whose costs are measured")
    p.add_argument("--measure-steps", type=int, default=None, help="steps of the measuring run (default 300; quick 40)")
    p.add_argument("--budget", type=float, default=0.02, help="checkpoint.overhead_budget")
    p.add_argument("--days", type=float, default=None, help="simulated job length (default 30; quick: 2)")
    p.add_argument("--replications", type=int, default=None, help="simulations per point (default 8; quick: 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the measuring run")
    p.add_argument("--tmpdir", default=None, help="where the measuring run's disk checkpoints go")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    p.add_argument("--quick", action="store_true", help="smoke mode: a short measurement, short jobs")
    add_load_argument(p)
    args = p.parse_args(argv)
    defaults = {"measure_steps": (40, 300), "days": (2.0, 30.0), "replications": (2, 8)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's own figures from a plain training loop with both tiers left to the budget."""
    from recipes._gpt import gpt_preset

    torch.set_num_threads(args.threads)
    wl = GPTWorkload(gpt_preset(args.preset), 1)
    root = Path(tempfile.mkdtemp(prefix="lr-bench-ettr-", dir=args.tmpdir))
    try:
        config = CheckpointConfig(overhead_budget=args.budget, cadence_review_steps=20)
        manager = CheckpointManager(
            [MemoryTier(every_n_steps=BUDGET, keep=2), LocalTier(root, every_n_steps=BUDGET, keep=2)], config
        )
        manager.setup()
        guard = manager.guard_optimizer(wl.opt)
        for step in range(1, args.measure_steps + 1):
            wl.step()
            manager.on_step(step, wl.state)
        manager.flush(args.measure_steps, wl.state)  # at least one persist, measured
        guard.remove()
        report = manager.cadence.report()
        local = manager.stats.tiers["local"]
        ram_restore = manager.restore()
        manager.close()
        fresh = CheckpointManager([LocalTier(root, every_n_steps=1, keep=2)])
        fresh.setup()
        t0 = time.perf_counter()
        restored = fresh.restore()
        disk_restore = time.perf_counter() - t0
        fresh.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    measured = dict(report["measured"])
    return {
        "step_s": measured["step_s"],
        "snapshot_s": measured["snapshot_s"],
        "persist_s": max(measured.get("persist_s", 0.0), measured["snapshot_s"]),
        "write_s": local.seconds / local.writes,
        "ram_restore_s": ram_restore.seconds if ram_restore is not None else 0.0,
        "disk_restore_s": disk_restore if restored is not None else None,
        "writes": local.writes,
        "engine_choice": report["tiers"],
    }


def _config(
    costs: dict[str, Any], mtbf_h: float, ranks: int, every: tuple[int, int], args: argparse.Namespace
) -> SimConfig:
    tiers = [
        SimTierConfig(
            name="memory",
            every_n_steps=every[0],
            blocking_s=costs["snapshot_s"],
            restore_s=costs["ram_restore_s"],
            durability=Durability.process,
        ),
        SimTierConfig(
            name="disk",
            every_n_steps=every[1],
            blocking_s=costs["persist_s"],
            write_s=costs["write_s"],
            restore_s=costs["disk_restore_s"] or costs["write_s"],
            durability=Durability.remote,
        ),
    ]
    cfg = SimConfig(
        cluster=ClusterConfig(gpus=ranks),
        failures=FailureConfig(mttf_s=mtbf_h * HOUR, ref_gpus=1024),
        tiers=tiers,
        job=JobConfig(step_s=costs["step_s"], horizon_s=args.days * DAY),
        overhead_budget=args.budget,
    )
    # the durable tier keeps the checkpoints of the SDC detection window (as a job that finds corruption late must):
    # with the default keep of 2, every SDC found an hour late would send every variant back to step 0, and the
    # comparison would measure that retention, not the cadence
    disk = next(c for c in cfg.cadences() if c.name == "disk")
    tiers[1].keep = max(2, math.ceil(SDC_WINDOW_S / (disk.every_n_steps * costs["step_s"])) + 1)
    return cfg


def simulate(costs: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for mtbf_h in MTBF_H:
        for ranks in RANKS:
            variants = {BUDGETED: (BUDGET, BUDGET), **FIXED}
            point: dict[str, Any] = {"mtbf_h_at_1024": mtbf_h, "ranks": ranks, "variants": {}}
            for name, every in variants.items():
                cfg = _config(costs, mtbf_h, ranks, every, args)
                mc = simulate_many(cfg, args.replications)
                point["job_mtbf_s"] = cfg.failures.job_mttf_s(ranks)
                point["variants"][name] = {
                    "ettr_mean": mc.ettr_mean,
                    "ettr_stderr": mc.ettr_stderr,
                    "cadences": [
                        {"tier": c.name, "every_n_steps": c.every_n_steps, "set_by": c.set_by, "reason": c.reason}
                        for c in cfg.cadences()
                    ],
                    "disk_keep": cfg.tiers[1].keep,
                    "breakdown_fraction": mc.breakdown_fractions(),
                }
            fixed = {n: v["ettr_mean"] for n, v in point["variants"].items() if n != BUDGETED}
            point["best_fixed"] = max(fixed, key=lambda n: fixed[n])
            point["budget_minus_best_fixed"] = point["variants"][BUDGETED]["ettr_mean"] - fixed[point["best_fixed"]]
            point["budget_minus_preset"] = point["variants"][BUDGETED]["ettr_mean"] - fixed[next(iter(FIXED))]
            budget = point["variants"][BUDGETED]["ettr_mean"]
            print_flush(
                f"[cadence_ettr] MTBF {mtbf_h:g} h@1024, {ranks} ranks: budget {budget:.4f}, "
                f"best fixed {point['best_fixed']} {fixed[point['best_fixed']]:.4f}"
            )
            rows.append(point)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    machine = machine_info()
    check_load_at_start(machine, allow=args.allow_loaded, quick=args.quick, name=MODULE)
    started = time.perf_counter()
    costs = measure(args)
    print_flush(
        f"[cadence_ettr] measured: step {fmt_ms(costs['step_s'])}, snapshot {fmt_ms(costs['snapshot_s'])}, persist "
        f"{fmt_ms(costs['persist_s'])}, write {fmt_ms(costs['write_s'])}"
    )
    head = result_header("cadence_ettr", TITLE, MODULE, argv, started, machine)  # the load: the measurement's
    rows = simulate(costs, args)
    worst = min(r["budget_minus_best_fixed"] for r in rows)
    result = {
        **head,
        "total_wall_s": time.perf_counter() - started,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "tmpdir")},
        "costs": costs,
        "points": rows,
        "targets": [
            target(
                "budgeted cadence: ETTR minus the best fixed cadence's (worst of the 4 points)",
                worst,
                ">=",
                -TOLERANCE,
                "",
                "the fixed cadences: the default preset's and the disk every 100 or 1,000 steps",
            )
        ],
    }
    return report(result, args.out, render_markdown)


def _pct(value: float) -> str:
    return f"{value * 100:.2f}%"


def render_markdown(r: dict[str, Any]) -> str:
    c, cfg, m = r["costs"], r["config"], r["machine"]
    variants = [BUDGETED, *FIXED]
    rows = []
    for p in r["points"]:
        cells = [f"{p['mtbf_h_at_1024']:g} h", f"{p['ranks']:,}", f"{p['job_mtbf_s'] / 60:.1f} min"]
        for name in variants:
            v = p["variants"][name]
            cells.append(f"{_pct(v['ettr_mean'])} ± {_pct(v['ettr_stderr'])}")
        cells.append(f"{(p['budget_minus_best_fixed']) * 100:+.2f} pt")
        rows.append(cells)
    out = [
        f"## {TITLE}",
        "",
        f"*Command:* `{r['command']}` · *Date:* {r['date']} · *Run time:* {r['total_wall_s'] / 60:.1f} min · "
        f"{load_line(m)} (during the measurement)"
        + (" · **quick (smoke) run: not a figure to publish**" if cfg["quick"] else ""),
        "",
        f"Costs the engine measured (GPT `{cfg['preset']}`, {cfg['measure_steps']} steps, on the CPU): step "
        f"{fmt_ms(c['step_s'])}, a snapshot blocks {fmt_ms(c['snapshot_s'])}, a persist {fmt_ms(c['persist_s'])} "
        f"(never counted below a snapshot), a write takes {fmt_ms(c['write_s'])}, a restore from the disk "
        f"{fmt_ms(c['disk_restore_s'])}. Simulated: {cfg['days']:g}-day jobs, {cfg['replications']} replications "
        "each (mean ± standard error), the simulator's default failure mix and restart costs; the disk tier stands "
        "for durable shared storage at the measured write cost, keeping the checkpoints of the last "
        f"{SDC_WINDOW_S / 3600:g} h (the failure mix finds an SDC that late; with two kept, every SDC would send "
        "every variant back to step 0).",
        "",
        md_table(["MTBF at 1,024 ranks", "ranks", "job MTBF", *variants, "budget - best fixed"], rows),
        "",
    ]
    for p in r["points"]:
        chosen = p["variants"][BUDGETED]["cadences"]
        out.append(
            f"* MTBF {p['mtbf_h_at_1024']:g} h at {p['ranks']:,} ranks, the budget chose: "
            + "; ".join(f"`{x['tier']}` every {x['every_n_steps']} ({x['reason']})" for x in chosen)
        )
    out += [
        "",
        md_table(
            ["target", "value", "goal", "verdict", "note"],
            [
                [
                    t["name"],
                    f"{t['value'] * 100:+.2f} pt",
                    f"{t['op']} {t['threshold'] * 100:g} pt",
                    t["verdict"],
                    t["note"],
                ]
                for t in r["targets"]
            ],
        ),
    ]
    return "\n".join(out) + "\n"


def readme_summary(r: dict[str, Any]) -> str:
    parts = []
    for p in r["points"]:
        budget = p["variants"][BUDGETED]["ettr_mean"]
        parts.append(
            f"MTBF {p['mtbf_h_at_1024']:g} h, {p['ranks'] // 1024}k ranks: {_pct(budget)} "
            f"({(p['budget_minus_preset']) * 100:+.1f} pt vs the preset, {(p['budget_minus_best_fixed']) * 100:+.1f} "
            "pt vs the best fixed)"
        )
    return (
        "**checkpoint cadence at scale** (simulated ETTR with measured costs, budgeted default): "
        + "; ".join(parts)
        + "."
    )


if __name__ == "__main__":
    raise SystemExit(main())
