"""What does SDC verification catch, how fast, and at what cost? Random bit flips against a 3-rank DDP run.

Run from the repository root::

    python -m benchmarks.sdc_coverage            # 16 flips per location x bit class (256), 3 gloo ranks
    python -m benchmarks.sdc_coverage --quick    # smoke mode: 2 flips per cell (seconds)

Coverage: three CPU processes train ``recipes._gpt.TinyGPT`` (tiny preset) under DDP on gloo with a plain loop and an
:class:`~lightning_resilience.sdc.SDCMonitor` in per-step mode (replay and reconciliation every step). Each trial
restarts from the same initial state, flips one bit on a random rank at a random early step (in a parameter, a
local gradient before the all-reduce, an AdamW state tensor, or a leaf module's activation; sign, exponent,
high-mantissa or low-mantissa bit), trains a few more steps and classifies the outcome:

* ``caught``: a corruption verdict naming exactly the injected rank;
* ``mislocated``: a verdict naming another set of ranks;
* ``missed``: no verdict, and the final state differs bitwise from the clean run (silent corruption survived);
* ``no_effect``: no verdict, and the final state is bitwise equal to the clean run (nothing measurable changed).

Coverage is ``caught / (trials - no_effect)``. ``guard_flagged`` counts trials in which the NaN/Inf guards alone
fired at the corrupt step (what catches such a flip between two replays at the default cadence; trials are too
short to warm the spike guards, so they do not count here). A "faulty device" row
makes one rank corrupt every gradient of one weight. Latency is in optimizer steps from the corrupt step.

Overhead (one process, same run): the median plain step against the time each mechanism spends, amortised over its
default cadence (``SDCConfig()``): guards every step, a dual-run replay round every ``replay_every_n_steps``, the
DDP bucket fingerprint every step (measured here as the digest of all gradients), a reconciliation digest every
``reconcile_every_n_steps`` (without the gather). With partner replay on several ranks a round costs two replays.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import command_line, fmt_pct, machine_info, md_table, now_iso, print_flush, target, write_json
from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.sdc.fingerprint import BitwiseDigest, digest_all
from lightning_resilience.sdc.guards import Guards
from lightning_resilience.sdc.inject import BIT_CLASSES, LOCATIONS, BitFlipInjector, FlipSpec
from lightning_resilience.sdc.monitor import SDCMonitor
from lightning_resilience.sdc.verdict import Verdict

MODULE = "benchmarks.sdc_coverage"
DEFAULT_OUT = "benchmarks/results/sdc_coverage.json"
TITLE = "SDC verification: coverage of random bit flips, detection latency and overhead per mechanism"
WORLD = 3
TRIAL_STEPS = 5

pc = time.perf_counter


def _model_kwargs(preset: str) -> dict[str, Any]:
    from recipes._gpt import gpt_preset

    kw = gpt_preset(preset)
    kw["max_steps"] = 1000
    return kw


def _batches(kw: dict[str, Any], rank: int, n: int, batch_size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(kw["vocab_size"], (batch_size, kw["seq_len"] + 1), generator=gen) for _ in range(n)]


def _loss(module: Any, batch: torch.Tensor) -> torch.Tensor:
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = module(inputs)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# --------------------------------------------------------------------------------------------------- overhead
def measure_overhead(args: argparse.Namespace) -> dict[str, Any]:
    from recipes._gpt import TinyGPT

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    kw = _model_kwargs(args.preset)
    model = TinyGPT(**kw)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = _batches(kw, 0, 8, args.batch_size)
    cfg = SDCConfig()
    monitor = SDCMonitor(list(model.named_parameters()), [opt], cfg)
    monitor.setup()
    monitor.attach(lambda b: _loss(model, b))
    digest = BitwiseDigest()

    def step(i: int, checked: bool) -> float:
        batch = batches[i % len(batches)]
        t0 = pc()
        if checked:
            monitor.begin_step(i, batch)
        loss = _loss(model, batch)
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

    for i in range(3):
        step(i, False)
    plain = [step(i, False) for i in range(args.overhead_steps)]
    g0 = monitor.stats.guard_seconds
    guarded = [step(i, True) for i in range(args.overhead_steps)]
    guard_per_step = (monitor.stats.guard_seconds - g0) / args.overhead_steps
    # one replay round, several times (its cost does not depend on the cadence)
    rounds = []
    for i in range(args.replay_reps):
        batch = batches[i % len(batches)]
        monitor.begin_step(i, batch)
        _loss(model, batch).backward()
        t0 = pc()
        monitor._replay_round(type("O", (), {"events": [], "suspects": [], "step": i})(), False)
        rounds.append(pc() - t0)
        opt.zero_grad(set_to_none=True)
    _loss(model, batches[0]).backward()
    fingerprints = []
    for _ in range(args.replay_reps):
        t0 = pc()
        digest_all(digest, [p.grad for p in model.parameters()])
        fingerprints.append(pc() - t0)
    opt.zero_grad(set_to_none=True)
    recon = []
    for _ in range(args.replay_reps):
        t0 = pc()
        monitor.reconciler.local()
        recon.append(pc() - t0)
    step_s = statistics.median(plain)
    replay_s, fp_s, recon_s = statistics.median(rounds), statistics.median(fingerprints), statistics.median(recon)
    return {
        "preset": args.preset,
        "batch_size": args.batch_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "plain_step_median_s": step_s,
        "guarded_step_median_s": statistics.median(guarded),
        "guards_per_step_s": guard_per_step,
        "replay_round_s": replay_s,
        "ddp_fingerprint_s": fp_s,
        "reconcile_digest_s": recon_s,
        "cadence": {
            "replay_every_n_steps": cfg.replay_every_n_steps,
            "reconcile_every_n_steps": cfg.reconcile_every_n_steps,
            "param_norm_every_n_steps": cfg.param_norm_every_n_steps,
        },
        "overhead_pct": {
            "guards": guard_per_step / step_s,
            "dual_run": replay_s / cfg.replay_every_n_steps / step_s,
            "dual_run_with_partner": 2 * replay_s / cfg.replay_every_n_steps / step_s,
            "ddp_fingerprint": fp_s / step_s,
            "reconcile": recon_s / cfg.reconcile_every_n_steps / step_s,
        },
    }


# --------------------------------------------------------------------------------------------------- coverage
def _trials(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    out = []
    for location in LOCATIONS:
        for bit_class in BIT_CLASSES:
            for _ in range(args.flips_per_cell):
                step = rng.randint(1, 2)
                out.append(dict(kind="flip", location=location, bit_class=bit_class, rank=rng.randrange(WORLD),
                                step=step, seed=rng.randrange(2**31)))  # fmt: skip
    for _ in range(args.faulty_trials):
        out.append(dict(kind="faulty", location="grad", bit_class="exponent", rank=rng.randrange(WORLD), step=1,
                        seed=rng.randrange(2**31)))  # fmt: skip
    return out


def _coverage_rank(rank: int, args_dict: dict[str, Any], trials: list[dict[str, Any]]) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from recipes._gpt import TinyGPT

    torch.use_deterministic_algorithms(True)
    kw = _model_kwargs(args_dict["preset"])
    torch.manual_seed(0)
    model = TinyGPT(**kw)
    model.train()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ddp = DistributedDataParallel(model)
    batches = _batches(kw, rank, TRIAL_STEPS, args_dict["batch_size"])
    monitor = SDCMonitor(
        list(model.named_parameters()), [], SDCConfig(replay_every_n_steps=1, reconcile_every_n_steps=1)
    )
    monitor.setup()
    monitor.attach(lambda b: _loss(model, b), ddp=ddp, synced_loss_fn=lambda b: _loss(ddp, b))

    def run(trial: dict[str, Any] | None) -> dict[str, Any]:
        with torch.no_grad():
            model.load_state_dict(init)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        monitor.optimizers = monitor.reconciler.optimizers = [opt]
        monitor.reset()
        # fresh baselines: every trial replays the same few steps, a baseline fed by earlier trials would be noise;
        # a trial is too short to warm the spike guards, so only the NaN/Inf guards can fire
        cfg = monitor.config
        monitor.guards = Guards(cfg.guard_window, cfg.guard_min_history, cfg.guard_threshold)
        torch.manual_seed(100 + rank)
        injector = BitFlipInjector(model, [opt], rank=rank)
        plan = []
        if trial is not None and trial["kind"] == "flip":
            plan = [FlipSpec(trial["location"], trial["step"], trial["rank"], trial["bit_class"], seed=trial["seed"])]
        fired_at: list[int] = []
        step_times = []
        for step, batch in enumerate(batches):
            if trial is not None and trial["kind"] == "faulty" and step == trial["step"] and rank == trial["rank"]:
                injector.faulty_device("grad", 1, bit_class="exponent", seed=trial["seed"])
            injector.on_step(step, plan)
            t0 = pc()
            fired_before = sum(monitor.stats.guard_fired.values())
            monitor.begin_step(step, batch)
            loss = _loss(ddp, batch)
            monitor.observe_loss(loss)
            loss.backward()
            monitor.before_optimizer_step()
            if sum(monitor.stats.guard_fired.values()) > fired_before:
                fired_at.append(step)
            opt.step()
            opt.zero_grad(set_to_none=True)
            monitor.after_optimizer_step()
            step_times.append(pc() - t0)
        injector.remove()
        digest = BitwiseDigest()
        final = digest_all(digest, [p.detach() for p in model.parameters()])
        events = [e.to_json() for e in monitor.events if e.verdict not in (Verdict.CLEAN, Verdict.ANOMALY)]
        return {"final": final.tolist(), "events": events, "guard_steps": fired_at,
                "step_s": statistics.median(step_times)}  # fmt: skip

    run(None)  # DDP rebuilds its buckets after the first iteration: the reference must use the final layout
    reference = run(None)
    results = []
    for trial in trials:
        r = run(trial)
        r["effect"] = r["final"] != reference["final"]
        del r["final"]
        results.append(r)
    return {"results": results if rank == 0 else [], "guard_results": [r["guard_steps"] for r in results],
            "step_s": reference["step_s"]}  # fmt: skip


def measure_coverage(args: argparse.Namespace) -> dict[str, Any]:
    from tests.sdc._spawn import run_ranks

    trials = _trials(args)
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        per_rank = run_ranks(
            _coverage_rank, WORLD, Path(tmp), {"preset": args.preset, "batch_size": 4}, trials, timeout_s=3600.0
        )
    results = per_rank[0]["results"]
    cells: dict[str, dict[str, Any]] = {}
    for i, (trial, res) in enumerate(zip(trials, results)):
        key = "faulty_device" if trial["kind"] == "faulty" else f"{trial['location']}/{trial['bit_class']}"
        cell = cells.setdefault(key, {"trials": 0, "caught": 0, "mislocated": 0, "missed": 0, "no_effect": 0,
                                      "guard_flagged": 0, "latencies": []})  # fmt: skip
        cell["trials"] += 1
        corrupt_step = trial["step"] + 1  # the state after the step in which the flip happened
        guard = any(trial["step"] in g for g in (per_rank[r]["guard_results"][i] for r in range(WORLD)))
        cell["guard_flagged"] += int(guard)
        if res["events"]:
            suspects = sorted({s for e in res["events"] for s in e["suspects"]})
            cell["caught" if suspects == [trial["rank"]] else "mislocated"] += 1
            cell["latencies"].append(min(e["step"] for e in res["events"]) - corrupt_step)
        elif res["effect"]:
            cell["missed"] += 1
        else:
            cell["no_effect"] += 1
    for cell in cells.values():
        effective = cell["trials"] - cell["no_effect"]
        cell["coverage"] = cell["caught"] / effective if effective else None
        lat = cell.pop("latencies")
        cell["latency_steps_mean"] = statistics.fmean(lat) if lat else None
        cell["latency_steps_max"] = max(lat) if lat else None
    return {"world_size": WORLD, "trial_steps": TRIAL_STEPS, "mode": "replay and reconcile every step",
            "cells": cells, "ddp_plain_step_median_s": per_rank[0]["step_s"]}  # fmt: skip


def _sign_exponent_coverage(cells: dict[str, dict[str, Any]]) -> float | None:
    caught = effective = 0
    for key, cell in cells.items():
        if key.endswith("/sign") or key.endswith("/exponent"):
            caught += cell["caught"]
            effective += cell["trials"] - cell["no_effect"]
    return caught / effective if effective else None


def render_markdown(result: dict[str, Any]) -> str:
    cov = result["coverage"]["cells"]
    rows = [[k, c["trials"], c["caught"], c["mislocated"], c["missed"], c["no_effect"], fmt_pct(c["coverage"]),
             c["guard_flagged"], c["latency_steps_mean"]] for k, c in cov.items()]  # fmt: skip
    ov = result["overhead"]["overhead_pct"]
    lines = [
        f"## {TITLE}",
        "",
        md_table(
            [
                "location/bit",
                "trials",
                "caught",
                "mislocated",
                "missed",
                "no effect",
                "coverage",
                "guards",
                "latency (steps)",
            ],
            rows,
        ),
        "",
        md_table(["mechanism", "overhead (% of step)"], [[k, fmt_pct(v)] for k, v in ov.items()]),
        "",
        md_table(["target", "value", "verdict"], [[t["name"], t["value"], t["verdict"]] for t in result["targets"]]),
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--preset", choices=["tiny", "small"], default="tiny", help="TinyGPT size preset")
    p.add_argument("--flips-per-cell", type=int, default=None, help="flips per location x bit class (16; quick: 2)")
    p.add_argument("--faulty-trials", type=int, default=None, help="faulty-device trials (10; quick: 2)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step, overhead run (64; quick: 16)")
    p.add_argument("--overhead-steps", type=int, default=None, help="steps per overhead figure (40; quick: 6)")
    p.add_argument("--replay-reps", type=int, default=None, help="repetitions of each timed mechanism (10; quick: 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in the overhead run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmpdir", default=None, help="where the ranks leave their results")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    p.add_argument("--quick", action="store_true", help="smoke mode: few flips and steps")
    args = p.parse_args(argv)
    q = args.quick
    args.flips_per_cell = args.flips_per_cell or (2 if q else 16)
    args.faulty_trials = args.faulty_trials if args.faulty_trials is not None else (2 if q else 10)
    args.overhead_steps = args.overhead_steps or (6 if q else 30)
    args.batch_size = args.batch_size or (16 if q else 64)
    args.replay_reps = args.replay_reps or (3 if q else 10)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    print_flush(f"{TITLE}\n(overhead on one process, then {WORLD}-rank coverage)")
    t0 = pc()
    overhead = measure_overhead(args)
    print_flush(
        f"overhead done in {pc() - t0:.1f}s: "
        + json.dumps({k: round(v * 100, 3) for k, v in overhead["overhead_pct"].items()})
        + " (%)"
    )
    coverage = measure_coverage(args)
    sign_exp = _sign_exponent_coverage(coverage["cells"])
    ov = overhead["overhead_pct"]
    result: dict[str, Any] = {
        "benchmark": MODULE,
        "title": TITLE,
        "command": command_line(MODULE, argv),
        "date": now_iso(),
        "machine": machine_info(),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "tmpdir")},
        "overhead": overhead,
        "coverage": coverage,
        "targets": [
            target(
                "sign/exponent flips caught and located to the right rank",
                sign_exp,
                ">=",
                0.99,
                note="per-step verification mode; excludes flips with no measurable effect",
            ),
            target("guards overhead (% of step)", ov["guards"] * 100, "<=", 0.1, "%"),
            target(
                "dual-run overhead at default cadence (% of step)",
                ov["dual_run_with_partner"] * 100,
                "<=",
                2.0,
                "%",
                note="two replays per round (self + partner)",
            ),
        ],
        "notes": [
            "Coverage is measured with replay and reconciliation every step: it is what each mechanism catches when it "
            "runs. At the default cadence a gradient or activation flip is caught when it falls on a replay step or "
            "when a guard fires (column guards: NaN/Inf guards only); a parameter or optimizer-state flip persists "
            "and is caught at the next reconciliation.",
            "no_effect: the final state is bitwise equal to the clean run (e.g. a flipped activation that dropout or "
            "a saturated nonlinearity discards): nothing to detect.",
            "Overhead figures are CPU timings of a small model: relative costs on a GPU differ (the replay costs the "
            "same fraction of a step, digests and norms are memory-bound passes).",
        ],
    }
    out = write_json(args.out, result)
    print_flush(render_markdown(result))
    print_flush(f"\nwrote {out} in {pc() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
