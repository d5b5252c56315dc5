"""How much do delta checkpoints save? Bytes and time per checkpoint, full shards against XOR+zstd deltas.

Run from the repository root::

    python -m benchmarks.delta_checkpoint            # TinyGPT tiny, 40 steps per run, a full shard every 10
    python -m benchmarks.delta_checkpoint --quick    # smoke mode: 12 steps, a full shard every 4 (seconds)

Each run trains ``recipes._gpt.TinyGPT`` (tiny preset, CPU) with a plain loop and checkpoints every step twice:
into a :class:`LocalTier` (every step a full shard) and into a :class:`DeltaLocalTier` (a full shard every
``--full-every`` writes, deltas against it in between), each in its own directory with retention ``keep=2``. Per
checkpoint it records the bytes committed (every file of the shard, manifest included) and the wall time of
``tier.write`` (with fsync), plus the size zstd alone reaches without a base (to separate what the XOR buys from
what compression buys). Runs:

* ``adamw``: the recipe's AdamW (betas 0.9/0.95, weight decay, warm-up then cosine LR), every parameter trained;
* ``sgd``: plain SGD (lr 0.1, no momentum, no weight decay): only the weights change, there is no optimizer state;
* ``finetune_frozen_emb``: AdamW with the token and position embeddings frozen (the LM head is tied to the token
  embedding, so it is frozen too);
* ``finetune_top_block``: AdamW training only the last block and the final LayerNorm (a typical fine-tune).

With dense Adam every weight and both moment estimates change at every step, so the XOR of two float32 values
mostly zeroes the sign/exponent byte and some high mantissa bits; the low mantissa bytes stay random and
incompressible. The figures below are what that achieves, not a promise of an order of magnitude.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._common import (
    command_line,
    machine_info,
    now_iso,
    print_flush,
    ratio,
    write_json,
)
from benchmarks._delta_render import TITLE, readme_summary, render_markdown
from benchmarks._workload import GPTWorkload
from lightning_resilience.checkpoint.delta import decode_delta, encode_delta
from lightning_resilience.checkpoint.delta_tier import DELTA_JSON, DeltaLocalTier
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.tier import TierIdentity

MODULE = "benchmarks.delta_checkpoint"
DEFAULT_OUT = "benchmarks/results/delta.json"
__all__ = ["DEFAULT_OUT", "TITLE", "main", "readme_summary", "render_markdown"]

pc = time.perf_counter


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    optimizer: str  # "adamw" (the recipe's) or "sgd"
    freeze: tuple[str, ...] = ()  # parameter-name prefixes with requires_grad=False
    train_only: tuple[str, ...] = ()  # if set: only parameters with these prefixes train


SCENARIOS = (
    Scenario("adamw", "AdamW (recipe), every parameter trained", "adamw"),
    Scenario("sgd", "SGD lr 0.1, no momentum, every parameter trained", "sgd"),
    Scenario(
        "finetune_frozen_emb",
        "AdamW, token+position embeddings frozen (tied LM head too)",
        "adamw",
        ("tok_emb", "pos_emb"),
    ),
    Scenario(
        "finetune_top_block", "AdamW, only the last block and ln_f trained", "adamw", train_only=("blocks.1.", "ln_f")
    ),
)


# ---------------------------------------------------------------------------------------------------- workload
def make_run(scenario: Scenario, model_kwargs: dict[str, Any], batch_size: int, seed: int) -> GPTWorkload:
    """TinyGPT trained by a plain loop on fixed random token batches, frozen and optimized as the scenario says."""

    def trainable(name: str) -> bool:
        if scenario.train_only:
            return name.startswith(scenario.train_only)
        return not (scenario.freeze and name.startswith(scenario.freeze))

    return GPTWorkload(model_kwargs, batch_size, seed, optimizer=scenario.optimizer, trainable=trainable)


def category(name: str) -> str:
    if "exp_avg_sq" in name:
        return "adam_v"
    if "exp_avg" in name:
        return "adam_m"
    if name.startswith("model/"):
        return "weights"
    return "other"


def shard_bytes(tier: LocalTier, step: int) -> int:
    return sum(p.stat().st_size for p in tier.shard_dir(step).iterdir() if p.is_file())


def apply_retention(tier: LocalTier) -> None:
    """What CheckpointManager does after each persist (newest ``keep`` steps stay)."""
    steps = tier.list_steps()
    for step in steps[: -tier.keep]:
        tier.delete(step)


def xor_zero_fractions(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> list[float] | None:
    """Over the float32 weights: the fraction of zero bytes in the XOR, per byte (0 = lowest mantissa byte)."""
    zeros = np.zeros(4)
    count = 0
    for name, tensor in new.items():
        if not name.startswith("model/") or tensor.dtype != torch.float32 or name not in base:
            continue
        x = np.bitwise_xor(
            tensor.contiguous().view(-1).numpy().view(np.uint32), base[name].view(-1).numpy().view(np.uint32)
        )
        for plane in range(4):
            zeros[plane] += np.count_nonzero(((x >> (8 * plane)) & 0xFF) == 0)
        count += x.size
    return [float(z / count) for z in zeros] if count else None


def lossy_probe(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], level: int) -> dict[str, Any]:
    """Opt-in lossy mode on one delta: tensor bytes after zstd, and the largest relative error on float32 values."""
    out: dict[str, Any] = {}
    for bits in (0, 8, 16):
        blobs, meta = encode_delta(base, new, level=level, lossy_bits=bits)
        decoded = decode_delta(base, blobs, meta)
        worst = 0.0
        for name, tensor in new.items():
            if tensor.dtype == torch.float32 and tensor.numel():
                err = (decoded[name] - tensor).abs() / tensor.abs().clamp_min(torch.finfo(torch.float32).tiny)
                worst = max(worst, float(err[torch.isfinite(err)].max()) if torch.isfinite(err).any() else 0.0)
        out[str(bits)] = {"tensor_bytes": sum(len(b) for b in blobs.values()), "max_rel_error": worst}
    return out


def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def timed_reads(tier: LocalTier, step: int, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start = pc()
        tier.read(step)
        samples.append(pc() - start)
    return statistics.median(samples)


def run_scenario(
    scenario: Scenario, args: argparse.Namespace, model_kwargs: dict[str, Any], root: Path
) -> dict[str, Any]:
    run = make_run(scenario, model_kwargs, args.batch_size, args.seed)
    full_tier = LocalTier(root / f"{scenario.name}-full", every_n_steps=1, keep=2)
    delta_tier = DeltaLocalTier(
        root / f"{scenario.name}-delta", every_n_steps=1, keep=2, full_every=args.full_every, level=args.level
    )
    for tier in (full_tier, delta_tier):
        tier.bind(TierIdentity())
    writes: list[dict[str, Any]] = []
    categories: dict[str, dict[str, Any]] = {}
    base_tensors: dict[str, torch.Tensor] = {}
    lossy: dict[str, Any] = {}
    zero_first: list[float] | None = None
    zero_last: list[float] | None = None
    losses = []
    for step in range(1, args.steps + 1):
        losses.append(float(run.step()))
        snap = run.snapshot(step)
        start = pc()
        full_tier.write(snap)
        full_s = pc() - start
        full_bytes = shard_bytes(full_tier, step)
        start = pc()
        delta_tier.write(snap)
        delta_s = pc() - start
        start = pc()
        blobs, _ = encode_delta({}, snap.tensors, level=args.level)
        zstd_s = pc() - start
        base = delta_tier.last_write_base
        writes.append(
            {
                "step": step,
                "kind": "full" if base is None else "delta",
                "base": base,
                "delta_tier_bytes": delta_tier.last_write_bytes,
                "delta_tier_s": delta_s,
                "full_tier_bytes": full_bytes,
                "full_tier_s": full_s,
                "zstd_only_bytes": sum(len(b) for b in blobs.values()),
                "zstd_only_encode_s": zstd_s,
                "raw_tensor_bytes": snap.nbytes,
            }
        )
        if base is None:
            base_tensors = {n: t.clone() for n, t in snap.tensors.items()}
        else:
            doc = json.loads((delta_tier.shard_dir(step) / DELTA_JSON).read_text())
            for name, entry in doc["tensors"].items():
                cat = categories.setdefault(category(name), {"raw": 0, "delta": 0, "zstd_only": 0})
                cat["raw"] += entry["nbytes"]
                cat["delta"] += entry["size"]
                cat["zstd_only"] += len(blobs[name])
            zeros = xor_zero_fractions(base_tensors, snap.tensors)
            if zero_first is None:
                zero_first = zeros
            zero_last = zeros
            if step == args.steps:
                lossy = lossy_probe(base_tensors, snap.tensors, args.level)
        apply_retention(full_tier)
        apply_retention(delta_tier)

    last = args.steps
    last_full = max(w["step"] for w in writes if w["kind"] == "full")
    read_full_s = timed_reads(full_tier, last, args.read_reps)
    read_delta_tier_full_s = timed_reads(delta_tier, last_full, args.read_reps)  # a retained delta keeps its base
    deltas = [w for w in writes if w["kind"] == "delta"]
    read_delta_s = timed_reads(delta_tier, last, args.read_reps) if writes[-1]["kind"] == "delta" else None

    full_bytes = [w["full_tier_bytes"] for w in writes]
    delta_bytes = [w["delta_tier_bytes"] for w in deltas]
    summary = {
        "full_bytes_median": median(full_bytes),
        "delta_bytes_median": median(delta_bytes),
        "delta_bytes_min": min(delta_bytes) if delta_bytes else None,
        "delta_bytes_max": max(delta_bytes) if delta_bytes else None,
        "ratio_full_over_delta": ratio(median(full_bytes), median(delta_bytes)),
        "amortized_bytes_per_write": statistics.fmean(w["delta_tier_bytes"] for w in writes),
        "zstd_only_bytes_median": median([w["zstd_only_bytes"] for w in writes]),
        "full_write_s_median": median([w["full_tier_s"] for w in writes]),
        "delta_write_s_median": median([w["delta_tier_s"] for w in deltas]),
        "delta_tier_full_write_s_median": median([w["delta_tier_s"] for w in writes if w["kind"] == "full"]),
        "zstd_only_encode_s_median": median([w["zstd_only_encode_s"] for w in writes]),
        "read_full_s": read_full_s,
        "read_delta_s": read_delta_s,
        "read_delta_tier_full_s": read_delta_tier_full_s,
    }
    summary["ratio_full_over_amortized"] = ratio(summary["full_bytes_median"], summary["amortized_bytes_per_write"])
    summary["ratio_full_over_zstd_only"] = ratio(summary["full_bytes_median"], summary["zstd_only_bytes_median"])
    trainable, total = run.param_counts()
    for cat in categories.values():
        cat_ratio = ratio(cat["raw"], cat["delta"])
        cat["raw_over_delta"] = round(cat_ratio, 3) if cat_ratio is not None else None
    return {
        "name": scenario.name,
        "description": scenario.description,
        "trainable_params": trainable,
        "total_params": total,
        "state_tensor_bytes": writes[-1]["raw_tensor_bytes"],
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "summary": summary,
        "delta_categories": categories,
        "xor_zero_byte_fraction": {"first_delta": zero_first, "last_delta": zero_last},
        "lossy_probe_last_delta": lossy,
        "writes": writes,
    }


# ------------------------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=["tiny", "small"], default="tiny", help="TinyGPT size preset")
    p.add_argument("--steps", type=int, default=None, help="training steps (= checkpoints) per run (40; quick: 12)")
    p.add_argument("--full-every", type=int, default=None, help="full shard every N writes (10; quick: 4)")
    p.add_argument("--level", type=int, default=3, help="zstd level of the deltas")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--read-reps", type=int, default=3, help="repetitions per read figure")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", action="append", default=None, help="run only this scenario (repeatable)")
    p.add_argument("--tmpdir", default=None, help="where checkpoints are written (default: system temp dir)")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    p.add_argument("--quick", action="store_true", help="smoke mode: few steps")
    args = p.parse_args(argv)
    args.steps = args.steps or (12 if args.quick else 40)
    args.full_every = args.full_every or (4 if args.quick else 10)
    if args.steps < 2 or args.full_every < 2:
        p.error("--steps and --full-every must be >= 2 (there must be deltas to measure)")
    known = [s.name for s in SCENARIOS]
    if args.only and set(args.only) - set(known):
        p.error(f"unknown scenario(s) {sorted(set(args.only) - set(known))}; known: {known}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import zstandard

    from recipes._gpt import gpt_preset

    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    argv = list(argv) if argv is not None else None
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_kwargs = gpt_preset(args.preset)
    root = Path(tempfile.mkdtemp(prefix="lr-delta-bench-", dir=args.tmpdir))
    runs = []
    try:
        for scenario in SCENARIOS:
            if args.only and scenario.name not in args.only:
                continue
            print_flush(f"[delta] {scenario.name}: {args.steps} steps ...")
            start = pc()
            runs.append(run_scenario(scenario, args, model_kwargs, root))
            print_flush(f"[delta] {scenario.name}: done in {pc() - start:.1f}s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "benchmark": "delta_checkpoint",
        "command": command_line(MODULE, sys.argv[1:] if argv is None else argv),
        "date": now_iso(),
        "machine": machine_info(),
        "zstandard": zstandard.__version__,
        "config": {
            "preset": args.preset,
            "steps": args.steps,
            "full_every": args.full_every,
            "level": args.level,
            "batch_size": args.batch_size,
            "threads": args.threads,
            "quick": args.quick,
            "keep": 2,
        },
        "runs": runs,
        "notes": (
            "Dense Adam changes every weight and both moments every step: XOR deltas of float32 mostly save the "
            "sign/exponent byte and some high mantissa bits. Large savings need parts of the state that stand still."
        ),
    }
    out = write_json(args.out, result)
    print_flush("")
    print_flush(render_markdown(result))
    print_flush(f"[delta] wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
