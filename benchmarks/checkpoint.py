"""What does a checkpoint every step cost the training step? Ours against the bare-copy floor, PyTorch DCP at its best
and Lightning's ModelCheckpoint, like for like.

Run from the repository root, on a quiet machine (it refuses to run when the load average exceeds the cores)::

    python -m benchmarks.checkpoint                  # small GPT (~23M params, 280 MB of state), ~40 min on 2 cores
    python -m benchmarks.checkpoint --quick --preset tiny    # smoke mode, a minute or two; nothing to publish

One training loop, one model; the contenders take turns of ``--turn`` steps (order reversed every other round), so
every one runs on the same machine at the same time, after an untimed warm-up turn each:

* ``none``: no checkpointing;
* ``floor``: a bare ``copy_`` of every tensor of the state into host buffers allocated once, each step (the least a
  per-step snapshot can cost on the training thread);
* ``ours_ram``: the RAM tier alone, every step (overlapped copy, the optimizer guard ``TieredCheckpoint`` installs);
* ``ours``: the default preset's tiers, RAM every step + local disk every 10;
* ``dcp_best_thread`` / ``dcp_best_process``: ``dcp.async_save`` with a reused ``DefaultStager`` (async staging,
  shared memory; pinned memory and non-blocking copies on a GPU), the wait on ``staging_completion`` in an
  optimizer pre-hook, thread or process executor, at our cadence (into RAM, a tmpfs directory, every step; local disk
  every 10 steps instead);
* ``dcp_own_thread`` / ``dcp_own_process``: the same at DCP's own best cadence, the local disk every 10 steps.

A turn's disk save comes on its first step; a turn whose write is still running after its last step trains on,
recorded, until it finishes (at most another turn), and what is left is drained and timed apart, never folded into a
step. Figures: the step-time slowdown against ``none`` (mean, median, p99 from 100 samples up, else the maximum, so
named), its ratio to the floor's, what each blocked the training thread, the restore time including
``load_state_dict``, and through Lightning ``TieredCheckpoint`` against ``ModelCheckpoint`` + ``AsyncCheckpointIO`` at
our cadence and at its own best one (the drain after the last step counted). ``--device cuda --dtype bf16`` runs the
same rotation on a GPU (``gpu_check`` does).
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

from benchmarks._checkpoint.contenders import BareCopy, DcpBest, NoCheckpoint, Ours, ram_dir
from benchmarks._checkpoint.render import README_PENDING, TITLE, readme_summary, render_markdown
from benchmarks._checkpoint.scenarios import LIGHTNING_KINDS, clean, run_lightning, run_restore, run_rotation, slowdown
from benchmarks._common import (
    add_load_argument,
    check_load_at_start,
    machine_info,
    print_flush,
    ratio,
    report,
    result_header,
    summarize,
    target,
)
from benchmarks._workload import GPTWorkload, state_tensors

__all__ = ["DEFAULT_OUT", "README_PENDING", "TITLE", "main", "readme_summary", "render_markdown", "run"]

MODULE = "benchmarks.checkpoint"
DEFAULT_OUT = "benchmarks/results/checkpoint.json"

TARGET_SLOWDOWN = 0.01
"""Per-step snapshots: at most 1% step-time slowdown (a GPU target: the copy overlaps the next forward/backward)."""
TARGET_FLOOR_RATIO = 1.2
"""A per-step RAM snapshot slows the step at most 1.2x as much as the bare copy of the same state (the floor)."""
TARGET_VS_DCP = 5.0
"""DCP at its best slows the step at least 5x as much as ours, same cadence."""
TARGET_RESTORE_SPEEDUP = 10.0
"""A RAM restore, ``load_state_dict`` included, at least 10x faster than a warm local-disk one."""

BIG_GPU_MODEL = {
    "vocab_size": 32768,
    "seq_len": 2048,
    "d_model": 2048,
    "n_layer": 20,
    "n_head": 16,
    "dropout": 0.0,
    "lr": 3e-4,
    "weight_decay": 0.1,
    "warmup_steps": 10,
    "max_steps": 10_000,
}
"""~1.08B parameters (12 * 20 * 2048^2 + the tied embedding): the GPU check's model."""


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    from recipes._gpt import gpt_preset

    cfg = dict(BIG_GPU_MODEL) if args.preset == "1b" else gpt_preset(args.preset)
    for key in ("d_model", "n_layer", "seq_len"):
        value = getattr(args, key)
        if value is not None:
            cfg[key] = value
    return cfg


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--preset", choices=["tiny", "small", "1b"], default="small", help="model size")
    p.add_argument("--d-model", type=int, default=None, help="override the preset's width")
    p.add_argument("--n-layer", type=int, default=None, help="override the preset's depth")
    p.add_argument("--seq-len", type=int, default=None, help="override the preset's sequence length")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="parameter dtype")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 1)")
    p.add_argument("--turn", type=int, default=10, help="steps per contender turn (one disk save per 10 steps)")
    p.add_argument("--rounds", type=int, default=None, help="turns per contender (default 30; quick: 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per contender first (default 10)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (rest: background work)")
    p.add_argument("--no-process", action="store_true", help="leave out DCP's process executor")
    p.add_argument("--no-dcp-own", action="store_true", help="leave out DCP at its own cadence (disk every 10)")
    p.add_argument("--restore-reps", type=int, default=None, help="repetitions per restore figure (default 5)")
    p.add_argument("--lightning-steps", type=int, default=None, help="measured steps per Trainer run (default 40)")
    p.add_argument("--lightning-passes", type=int, default=None, help="Trainer runs per kind (default 3)")
    p.add_argument("--no-lightning", action="store_true", help="skip the Lightning runs")
    p.add_argument("--tmpdir", default=None, help="where disk checkpoints go (default: the system temp dir)")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    p.add_argument("--quick", action="store_true", help="smoke mode: few steps, nothing to publish")
    add_load_argument(p)
    args = p.parse_args(argv)
    q = args.quick
    defaults = {
        "batch_size": (1, 1),
        "rounds": (1, 30),
        "warmup": (3, 10),
        "restore_reps": (2, 5),
        "lightning_steps": (6, 40),
        "lightning_passes": (1, 3),
    }
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    for name in ("batch_size", "turn", "rounds", "restore_reps", "lightning_steps", "lightning_passes", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _init_single_rank_group(root: Path) -> None:
    """DCP's process executor needs a process group: one rank of gloo (our engine sees a world of one)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.FileStore(str(root / "pg_store"), 1), rank=0, world_size=1)


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(args.threads)
    machine = machine_info()
    check_load_at_start(machine, allow=args.allow_loaded, quick=args.quick, name=MODULE)
    if args.device.startswith("cuda"):
        machine["device"] = torch.cuda.get_device_name(0)
    cfg = model_config(args)
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    started = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix="lr-bench-ckpt-", dir=args.tmpdir))
    _init_single_rank_group(base)
    wl = GPTWorkload(cfg, args.batch_size, device=args.device, dtype=dtype)
    wl.step()  # AdamW allocates its state on the first step: from here on the state has its full size
    n_params = sum(p.numel() for p in wl.model.parameters())
    state_bytes = sum(t.numel() * t.element_size() for t in state_tensors(wl.state()))
    # two DCP executors keep two saves each in RAM; a small /dev/shm (a container's 64 MB) is not used
    shm, in_ram = ram_dir("lr-bench-dcp-", need_bytes=5 * state_bytes)
    try:
        print_flush(
            f"[checkpoint] {args.preset}: {n_params / 1e6:.1f}M params, {state_bytes / 1e6:.0f} MB of state on "
            f"{machine.get('device', args.device)}; turns of {args.turn} x {args.rounds} rounds; dcp RAM dir "
            f"{shm} ({'tmpfs' if in_ram else 'disk: no /dev/shm with room'})"
        )
        ours = Ours(wl, base / "ours")
        executors = [False] if args.no_process else [False, True]
        dcps = [DcpBest(wl, shm / f"best{p:d}", base / f"dcp_best{p:d}", process=p) for p in executors]
        if not args.no_dcp_own:
            dcps += [
                DcpBest(wl, shm / f"own{p:d}", base / f"dcp_own{p:d}", process=p, every_step=False) for p in executors
            ]
        floor = BareCopy(wl)
        contenders = [NoCheckpoint(), floor, Ours(wl, base / "ram", disk_every=None, name="ours_ram"), ours, *dcps]
        rec = run_rotation(wl, contenders, warmup=args.warmup, turn=args.turn, rounds=args.rounds, device=args.device)
        print_flush(
            "[checkpoint] rotation done: "
            + ", ".join(f"{c.name} {summarize(rec[c.name]['step_s'])['mean_s'] * 1e3:.1f} ms" for c in contenders)
        )
        restore = run_restore(wl, ours, base / "ours", dcps[0], args.restore_reps)
        details = {c.name: c.close() for c in contenders}
        del wl
        clean(base / "ours")
        lightning: dict[str, Any] = {}
        if not args.no_lightning and not args.device.startswith("cuda"):
            lightning = _lightning(args, cfg, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    steps = {name: summarize(r["step_s"]) for name, r in rec.items()}
    blocking = {name: summarize(r["blocking_s"]) for name, r in rec.items() if name != "none"}
    slow = {name: slowdown(rec, name) for name in rec if name != "none"}
    drains = {name: summarize(r["drain_s"]) | {"tail_steps": r["tail_steps"]} for name, r in rec.items()}
    best_dcp = min((n for n in slow if n.startswith("dcp_best")), key=lambda n: slow[n]["mean"] or math.inf)
    own = [n for n in slow if n.startswith("dcp_own")]
    ratios: dict[str, Any] = {
        "best_dcp": best_dcp,
        "best_dcp_own_cadence": min(own, key=lambda n: slow[n]["mean"] or math.inf) if own else None,
        **{f"{n}_over_floor_{k}": _over_floor(slow, n, k) for n in slow if n != "floor" for k in ("mean", "p99")},
        "dcp_over_ours_slowdown_mean": ratio(slow[best_dcp]["mean"], slow["ours"]["mean"]),
        "dcp_over_ours_slowdown_p99": ratio(slow[best_dcp]["p99"], slow["ours"]["p99"]),
        "dcp_over_ours_blocking_mean": ratio(blocking[best_dcp]["mean_s"], blocking["ours"]["mean_s"]),
        "restore_disk_warm_over_ram": ratio(
            restore["ours_disk_warm"]["total"]["median_s"], restore["ours_ram"]["total"]["median_s"]
        ),
        "restore_disk_cold_over_ram": ratio(
            restore["ours_disk_cold"]["total"]["median_s"], restore["ours_ram"]["total"]["median_s"]
        ),
        "restore_dcp_ram_over_ours_ram": ratio(
            (restore.get("dcp_ram") or {}).get("total", {}).get("median_s"), restore["ours_ram"]["total"]["median_s"]
        ),
    }
    if lightning:
        for kind in ("modelcheckpoint_same", "modelcheckpoint_best"):
            ratios[f"lightning_{kind}_over_tiered"] = ratio(
                lightning["slowdown"][kind], lightning["slowdown"]["tiered"]
            )
    device_note = "GPU target" if not args.device.startswith("cuda") else machine.get("device", "GPU")
    targets = [
        target(
            "per-step RAM snapshot / bare-copy floor (step-time slowdown, mean)",
            ratios["ours_ram_over_floor_mean"],
            "<=",
            TARGET_FLOOR_RATIO,
            "x",
            "ours_ram against floor: the same state copied each step, ours overlapped and guarded",
        ),
        target(
            "step-time slowdown of per-step snapshots (mean, ours vs none)",
            slow["ours"]["mean"],
            "<=",
            TARGET_SLOWDOWN,
            "fraction",
            f"{device_note}: the copy overlaps the next forward/backward on a GPU; on a CPU it shares the cores",
        ),
        target(
            f"slowdown of DCP at its best / ours (mean, same cadence; {best_dcp})",
            ratios["dcp_over_ours_slowdown_mean"],
            ">=",
            TARGET_VS_DCP,
            "x",
        ),
        target(
            "restore incl. load_state_dict: local disk (warm) / RAM",
            ratios["restore_disk_warm_over_ram"],
            ">=",
            TARGET_RESTORE_SPEEDUP,
            "x",
        ),
    ]
    return {
        **result_header("checkpoint", TITLE, MODULE, argv, started, machine),
        "config": {
            "preset": args.preset,
            "model": cfg,
            "params": n_params,
            "state_bytes": state_bytes,
            "device": args.device,
            "dtype": args.dtype,
            "batch_size": args.batch_size,
            "threads": args.threads,
            "turn": args.turn,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "dcp_ram_dir_is_tmpfs": in_ram,
            "tail_steps_max": args.turn,
            "restore_reps": args.restore_reps,
            "quick": args.quick,
        },
        "step_time": steps,
        "blocking": blocking,
        "slowdown": slow,
        "drain": drains,
        "details": details,
        "restore": restore,
        "lightning": lightning,
        "ratios": ratios,
        "targets": targets,
    }


def _over_floor(slow: dict[str, dict[str, Any]], name: str, key: str) -> float | None:
    """``name``'s slowdown over the floor's (0 when ``name`` shows none); None when the floor's is not above zero
    (within the machine's noise)."""
    mine, floor = slow[name].get(key), slow["floor"].get(key)
    return ratio(max(mine, 0.0), floor) if mine is not None and floor is not None and floor > 0 else None


def _lightning(args: argparse.Namespace, cfg: dict[str, Any], base: Path) -> dict[str, Any]:
    kinds = list(LIGHTNING_KINDS)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for i in range(args.lightning_passes):
        for kind in kinds if i % 2 == 0 else kinds[::-1]:
            root = base / f"pl_{kind}_{i}"
            print_flush(f"[checkpoint]   Trainer pass {i + 1}: {kind}")
            ram, _ = ram_dir("lr-bench-pl-")
            try:
                runs[kind].append(
                    run_lightning(
                        kind, cfg, args.batch_size, root, args.lightning_steps, args.warmup, args.threads, ram
                    )
                )
            finally:
                clean(root)
                shutil.rmtree(ram, ignore_errors=True)
    mean = {k: sum(r["mean_step_with_drain_s"] for r in rs) / len(rs) for k, rs in runs.items()}
    return {
        "runs": runs,
        "mean_step_with_drain_s": mean,
        "step_interval": {
            k: summarize(x for r in rs for x in r["step_interval"]["samples_s"]) for k, rs in runs.items()
        },
        "slowdown": {k: mean[k] / mean["none"] - 1.0 for k in kinds if k != "none"},
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    return report(run(args, argv), args.out, render_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
