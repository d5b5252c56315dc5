"""Does the cost budget hold? A state too heavy to snapshot every step within it, and the engine left to choose.

Run from the repository root, on a quiet machine::

    python -m benchmarks.checkpoint_budget                   # small GPT + 2x its state in extra buffers, ~15 min
    python -m benchmarks.checkpoint_budget --quick --preset tiny    # smoke mode, under a minute; nothing to publish

The state is the small GPT's model and AdamW state plus ``--ballast`` times as many bytes of buffers the optimizer
does not own (EMA weights, say): they are copied on the training thread, so a snapshot every step costs far more
than the 2% budget (``checkpoint.overhead_budget``). One training loop; the contenders take turns of ``--turn``
steps (order reversed every other round), after an untimed warm-up turn in which the engine measures and chooses:

* ``none``: no checkpointing;
* ``every_step``: ``MemoryTier(every_n_steps=1)``, the cadence set: a snapshot every step whatever it costs;
* ``budget``: ``MemoryTier(every_n_steps=0)``: the engine chooses from what a snapshot costs it;
* ``budget_disk``: ``MemoryTier(0)`` and ``LocalTier(0)``: both cadences chosen (the disk at Daly's interval from the
  persist cost and the MTBF prior).

Figures: the cadence each budgeted engine chose and why (its own words), what the engine blocks (the training
thread's time in it over its time in the steps), its whole cost measured inside its own turns (the steps no snapshot
touched against all of them: blocking and the slower steps after a snapshot) and the step-time slowdown against
``none``, for every contender.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks._checkpoint.contenders import Contender, NoCheckpoint, Ours
from benchmarks._checkpoint.scenarios import run_rotation, slowdown, within_turns
from benchmarks._common import (
    add_load_argument,
    check_load_at_start,
    fmt_interval,
    fmt_ms,
    load_line,
    machine_info,
    md_table,
    print_flush,
    report,
    result_header,
    summarize,
    target,
)
from benchmarks._workload import GPTWorkload, state_tensors
from lightning_resilience.checkpoint.cadence import BUDGET
from lightning_resilience.checkpoint.config import CheckpointConfig

__all__ = ["DEFAULT_OUT", "README_PENDING", "TITLE", "main", "readme_summary", "render_markdown"]

MODULE = "benchmarks.checkpoint_budget"
DEFAULT_OUT = "benchmarks/results/checkpoint_budget.json"
TITLE = "Checkpoint cost budget: a state too heavy for every step, the cadence the engine chooses, the cost it lands"
README_PENDING = (
    "**checkpoint cost budget** (a state too heavy to snapshot every step): pending a run on a quiet machine "
    "(`python -m benchmarks.checkpoint_budget`)."
)
TOLERANCE = 0.25
"""The cost lands within the budget +-25%."""


class BallastWorkload(GPTWorkload):
    """The GPT workload whose state also holds ``ballast_bytes`` of buffers the optimizer does not own."""

    def __init__(self, model_kwargs: dict[str, Any], batch_size: int, ballast_bytes: int) -> None:
        super().__init__(model_kwargs, batch_size)
        self.ballast = {"ema": torch.randn(max(ballast_bytes // 4, 1))}

    def state(self) -> dict[str, Any]:
        return {**super().state(), "buffers": self.ballast}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--preset", choices=["tiny", "small"], default="small", help="model size")
    p.add_argument(
        "--ballast", type=float, default=2.0, help="extra buffers, as a multiple of the model+optimizer state"
    )
    p.add_argument("--budget", type=float, default=0.02, help="checkpoint.overhead_budget")
    p.add_argument("--turn", type=int, default=None, help="steps per contender turn (default 40; quick: 20)")
    p.add_argument("--rounds", type=int, default=None, help="turns per contender (default 8; quick: 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per contender first (default 240; quick 20)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (rest: background work)")
    p.add_argument("--tmpdir", default=None, help="where disk checkpoints go (default: the system temp dir)")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    p.add_argument("--quick", action="store_true", help="smoke mode: few steps, nothing to publish")
    add_load_argument(p)
    args = p.parse_args(argv)
    # the full warm-up outlasts two cadence reviews (100 steps each): by the first timed turn the engine has measured
    # what a snapshot slows the step after it by, which needs the snapshots spaced out first
    for name, (quick, full) in {"turn": (20, 40), "rounds": (1, 8), "warmup": (20, 240)}.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if not 0 < args.budget < 1:
        p.error("--budget must be in (0, 1)")
    return args


def _engine_cost(rec: dict[str, list[float]]) -> float | None:
    """The training thread's time in the engine over its time in the steps."""
    blocked, total = sum(rec["blocking_s"]), sum(rec["step_s"])
    return blocked / (total - blocked) if total > blocked else None


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from recipes._gpt import gpt_preset

    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(args.threads)
    machine = machine_info()
    check_load_at_start(machine, allow=args.allow_loaded, quick=args.quick, name=MODULE)
    started = time.perf_counter()
    cfg = gpt_preset(args.preset)
    probe = GPTWorkload(cfg, 1)
    probe.step()
    model_bytes = sum(t.numel() * t.element_size() for t in state_tensors(probe.state()))
    del probe
    wl = BallastWorkload(cfg, 1, int(args.ballast * model_bytes))
    wl.step()
    state_bytes = sum(t.numel() * t.element_size() for t in state_tensors(wl.state()))
    base = Path(tempfile.mkdtemp(prefix="lr-bench-budget-", dir=args.tmpdir))
    config = CheckpointConfig(overhead_budget=args.budget)
    try:
        print_flush(f"[budget] {args.preset} + ballast: {state_bytes / 1e6:.0f} MB of state, budget {args.budget:.1%}")
        contenders: list[Contender] = [
            NoCheckpoint(),
            Ours(wl, base / "a", disk_every=None, name="every_step", config=config),
            Ours(wl, base / "b", disk_every=None, ram_every=BUDGET, name="budget", config=config),
            Ours(wl, base / "c", disk_every=BUDGET, ram_every=BUDGET, name="budget_disk", config=config),
        ]
        rec = run_rotation(wl, contenders, warmup=args.warmup, turn=args.turn, rounds=args.rounds)
        details = {c.name: c.close() for c in contenders}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    engines = {name: _engine_cost(r) for name, r in rec.items() if name != "none"}
    slow = {name: slowdown(rec, name) for name in rec if name != "none"}
    whole = {name: within_turns(rec, name) for name in rec if name != "none"}
    budget_whole = (whole["budget"] or {}).get("mean")
    chosen = {name: (details[name].get("cadence") or {}) for name in ("budget", "budget_disk")}
    lo, hi = (1 - TOLERANCE) * args.budget, (1 + TOLERANCE) * args.budget
    targets = [
        target(
            "every-step snapshots: blocking / budget (a state too heavy for it)",
            _ratio(engines["every_step"], args.budget),
            ">=",
            2.0,
            "x",
            "the premise: every step costs at least twice the budget",
        ),
        target(
            "budgeted RAM tier: its whole cost within its turns, at most budget + 25%",
            budget_whole,
            "<=",
            hi,
            "fraction",
            "the mean step over the steps no snapshot touched, in the same turns: blocking and slower steps after a "
            "snapshot; per turn: " + fmt_interval((whole["budget"] or {}).get("per_turn") or [], "turns"),
        ),
        target(
            "budgeted RAM tier: its whole cost within its turns, at least budget - 25%",
            budget_whole,
            ">=",
            lo,
            "fraction",
        ),
        target(
            "budgeted RAM tier: step-time slowdown (mean), at most budget + 25%",
            slow["budget"]["mean"],
            "<=",
            hi,
            "fraction",
            "includes what the copy takes from the training thread's cores beside its blocking; per turn: "
            + fmt_interval(slow["budget"]["per_turn"], "turns"),
        ),
    ]
    return {
        **result_header("checkpoint_budget", TITLE, MODULE, argv, started, machine),
        "config": {
            "preset": args.preset,
            "model": cfg,
            "model_state_bytes": model_bytes,
            "state_bytes": state_bytes,
            "ballast": args.ballast,
            "budget": args.budget,
            "turn": args.turn,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "threads": args.threads,
            "quick": args.quick,
        },
        "step_time": {name: summarize(r["step_s"]) for name, r in rec.items()},
        "slowdown": slow,
        "engine_cost": engines,
        "within_turns": whole,
        "cadence": chosen,
        "details": {name: {k: v for k, v in d.items() if k != "cadence"} for name, d in details.items()},
        "targets": targets,
    }


def _ratio(value: float | None, by: float) -> float | None:
    return None if value is None else value / by


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.2f}%"


def render_markdown(r: dict[str, Any]) -> str:
    cfg, m = r["config"], r["machine"]
    device = m.get("device") or f"CPU ({m['cpu_count']} cores, {m['cpu_model']})"
    out = [
        f"## {TITLE}",
        "",
        f"GPT `{cfg['preset']}` + AdamW ({cfg['model_state_bytes'] / 1e6:.0f} MB) and {cfg['ballast']:g}x as many "
        f"bytes of buffers the optimizer does not own: {cfg['state_bytes'] / 1e6:.0f} MB of state, on {device}; "
        f"budget {cfg['budget']:.1%} of the step time; {load_line(m)}.",
        "",
        f"*Command:* `{r['command']}` · *Date:* {r['date']} · *Run time:* {r['total_wall_s'] / 60:.1f} min"
        + (" · **quick (smoke) run: not a figure to publish**" if cfg["quick"] else ""),
        "",
        f"Method: one training loop; each contender trains {cfg['turn']} consecutive steps in turn, {cfg['rounds']} "
        f"round(s) (order reversed every other round), after an untimed warm-up turn of {cfg['warmup']} steps each "
        "in which a budgeted engine measures and makes its first choice (it chooses again every "
        "`checkpoint.cadence_review_steps`). *Blocking*: the training thread's time in the engine over its time in "
        "the steps; *whole cost*: each turn's mean step over the mean of its steps that no snapshot nor the "
        "background copy of the one before touched, less one (blocking and slower steps after a snapshot, what the "
        "budget bounds, measured inside the contender's own turns so that the machine's drift between turns "
        "cancels); *slowdown*: the mean step against `none`'s turns, which also holds what background work takes "
        "from every step alike, to the precision of that drift.",
        "",
    ]
    rows = []
    for name, s in r["step_time"].items():
        plan = (r["cadence"].get(name) or {}).get("tiers", {})
        every = ", ".join(f"{t} every {c['every_n_steps']}" for t, c in plan.items()) or (
            "memory every 1 (set)" if name == "every_step" else ""
        )
        rows.append(
            [
                name,
                fmt_ms(s["mean_s"]),
                _pct(r["slowdown"].get(name, {}).get("mean")) if name != "none" else "",
                _pct(((r.get("within_turns") or {}).get(name) or {}).get("mean")) if name != "none" else "",
                _pct(r["engine_cost"].get(name)) if name != "none" else "",
                every,
            ]
        )
    out += [md_table(["contender", "mean step", "slowdown (mean)", "whole cost", "blocking", "cadence"], rows), ""]
    for name, plan in r["cadence"].items():
        for tier, c in (plan.get("tiers") or {}).items():
            out.append(f"* `{name}`, tier `{tier}`: every {c['every_n_steps']} steps — {c['reason']}.")
    budget_turns = (r["slowdown"].get("budget") or {}).get("per_turn") or []
    if budget_turns:
        out += [
            "",
            f"The budgeted engine's slowdown turn by turn ({fmt_interval(budget_turns, 'turns')}): the drift "
            "between turns on this machine is wider than the budget itself, so the step-time target is decided "
            "only to that precision; the whole cost, measured inside the turns, resolves the budget.",
        ]
    out += [
        "",
        md_table(
            ["target", "value", "goal", "verdict", "note"],
            [[t["name"], _value(t), f"{t['op']} {t['threshold']:g}", t["verdict"], t["note"]] for t in r["targets"]],
        ),
    ]
    return "\n".join(out) + "\n"


def _value(t: dict[str, Any]) -> str:
    v = t["value"]
    if v is None:
        return "n/a"
    return f"{v * 100:.2f}%" if t["unit"] == "fraction" else f"{v:.2f}{t['unit']}"


def readme_summary(r: dict[str, Any]) -> str:
    cfg = r["config"]
    memory = ((r["cadence"].get("budget") or {}).get("tiers") or {}).get("memory") or {}
    return (
        f"**checkpoint cost budget** ({cfg['state_bytes'] / 1e6:.0f} MB of state, budget {cfg['budget']:.0%}): a "
        f"snapshot every step blocks {_pct(r['engine_cost']['every_step'])} of the step; left to the budget the engine "
        f"snapshots every {memory.get('every_n_steps', '?')} steps on its own and costs "
        f"{_pct(((r.get('within_turns') or {}).get('budget') or {}).get('mean'))} of the step in all, blocking "
        f"{_pct(r['engine_cost']['budget'])} ({_pct(r['slowdown']['budget']['mean'])} step-time slowdown against "
        "the turns without checkpointing)."
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    return report(run(args, argv), args.out, render_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
