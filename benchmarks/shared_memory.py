"""Snapshots in shared memory: what the per-step snapshot costs against the in-process one and the bare-copy floor,
and how fast a restarted process restores from shared memory against a warm local disk.

Usage (from the repository root)::

    python -m benchmarks.shared_memory                          # the published run (minutes on 2 quiet cores)
    python -m benchmarks.shared_memory --quick --preset tiny    # smoke mode, nothing to publish

* **Step time** (one run, interleaved): the contenders take turns of ``--turn`` steps on one model (the order
  reversed every other round, each turn's background work waited for at its end and counted in its mean, not in
  one of its steps), so all see the same machine: ``none``; ``floor``, a bare ``copy_`` of the state's
  tensors into preallocated host buffers every step (what the hardware allows); ``process``, the engine's RAM tier
  in process memory every step; ``shared``, the RAM tier in shared memory every step (the default preset's; its
  buffers in ``--shm-dir``, ``/dev/shm`` by default: a tmpfs, as a job keeps them); and
  the two with the local disk every 10 steps (``process+disk``: the shard written by the persist thread;
  ``shared+disk``: by the writer process, off the trainer's GIL). Each contender's figures: mean, median and p99 step
  time (the maximum when a contender has fewer than 100 samples), slowdown over ``none``, ratio to ``floor``.
* **Restore**: a process that trained and snapshotted dies; a new process restores the newest step with a fresh
  engine, from shared memory (the dead process's buffers) and from the local disk (the same step, page cache warm):
  seconds from the start of the restore to the state in hand, median of ``--restore-reps``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import _common as bench
from benchmarks._workload import GPTWorkload

MODULE = "benchmarks.shared_memory"
TITLE = "Snapshots in shared memory: step-time cost against the bare-copy floor, restore against local disk"
DEFAULT_OUT = str(bench.RESULTS_DIR / "shared_memory.json")
DISK_EVERY = 10
SHM_DIR = "/dev/shm"
CONTENDERS = ("none", "floor", "process", "shared", "process+disk", "shared+disk")
README_PENDING = f"**{TITLE}**: no result yet (`python -m {MODULE}` on a quiet machine)."


class _Contender:
    """One way of checkpointing every step (``after_step``, right after the optimizer step; ``step`` counts them,
    each turn starting on a disk step)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.hooks: list[Any] = []
        self.step = DISK_EVERY * 1000

    def begin(self) -> None: ...

    def after_step(self) -> None: ...

    def end_turn(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def close(self) -> None: ...


class _Floor(_Contender):
    """A bare copy of every tensor of the state into buffers allocated once: the physical floor."""

    def __init__(self, wl: GPTWorkload) -> None:
        super().__init__("floor")
        self.wl = wl
        self.buffers: list[torch.Tensor] | None = None

    def after_step(self) -> None:
        wl = self.wl
        tensors = [*wl.model.state_dict().values()]
        tensors += [v for st in wl.opt.state.values() for v in st.values() if torch.is_tensor(v)]
        if self.buffers is None:
            self.buffers = [torch.empty_like(t, device="cpu") for t in tensors]
        for dst, src in zip(self.buffers, tensors):
            dst.copy_(src)


class _Engine(_Contender):
    """The checkpoint engine with the default preset's tiers (RAM every step, optionally disk every 10), the overlapped
    copy and the optimizer guard that ``TieredCheckpoint`` installs."""

    def __init__(self, name: str, wl: GPTWorkload, root: Path, shm: Path, *, shared: bool, disk: bool) -> None:
        from lightning_resilience.checkpoint import CheckpointManager, LocalTier, MemoryTier

        super().__init__(name)
        self.wl = wl
        memory = MemoryTier(every_n_steps=1, keep=2, shared_memory=shared, shm_dir=str(shm / name), run_id=name)
        tiers: list[Any] = [memory]
        if disk:
            tiers.append(LocalTier(root / "disk", every_n_steps=DISK_EVERY, keep=2))
        self.manager = CheckpointManager(tiers)
        self.manager.setup()

    def begin(self) -> None:
        self.hooks = [self.manager.guard_optimizer(self.wl.opt)]

    def after_step(self) -> None:
        from lightning_resilience.checkpoint.tree import storage_ptr

        owned = {storage_ptr(p) for p in self.wl.model.parameters()}
        owned |= {storage_ptr(v) for st in self.wl.opt.state.values() for v in st.values() if torch.is_tensor(v)}
        self.manager.on_step(self.step, self.wl.state, overlap=lambda t: storage_ptr(t) in owned)

    def end_turn(self) -> None:
        self.manager.wait_snapshot()
        self.manager.wait()
        super().end_turn()

    def close(self) -> None:
        self.manager.close(finished=True)


def _rotation(wl: GPTWorkload, contenders: list[_Contender], *, warmup: int, turn: int, rounds: int) -> dict[str, Any]:
    """Per contender, ``rounds`` turns of ``turn`` steps (after ``warmup`` untimed ones): each step's time from its
    start to the next step's start, and each turn's drain (the wait for its background work) apart."""
    record: dict[str, dict[str, list[float]]] = {c.name: {"steps": [], "drains": []} for c in contenders}

    def train(c: _Contender) -> float:
        wl.step()
        c.after_step()
        c.step += 1
        return time.perf_counter()

    def one_turn(c: _Contender, n: int) -> tuple[list[float], float]:
        c.begin()
        marks = [time.perf_counter(), *(train(c) for _ in range(n))]
        c.end_turn()
        drained = time.perf_counter() - marks[-1]
        gc.collect()
        return [b - a for a, b in itertools.pairwise(marks)], drained

    for c in contenders:
        one_turn(c, warmup)
    for i in range(rounds):
        for c in contenders if i % 2 == 0 else contenders[::-1]:
            steps, drained = one_turn(c, turn)
            record[c.name]["steps"] += steps
            record[c.name]["drains"].append(drained)
    return record


def _figures(record: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Mean step time counts the drains (work the contender still owed at the end of its turns); the median and the
    tail are of the steps themselves."""

    def mean(name: str) -> float:
        r = record[name]
        return (sum(r["steps"]) + sum(r["drains"])) / len(r["steps"])

    base, floor = mean("none"), mean("floor")
    out = {}
    for name, r in record.items():
        s = bench.summarize(r["steps"])
        tail = "p99" if s["n"] >= 100 else "max"
        cost = mean(name) - base
        out[name] = {
            "n": s["n"],
            "mean_s": mean(name),
            "median_s": s["median_s"],
            "p99_s": s["p99_s"],
            "max_s": s["max_s"],
            "tail": tail,
            "slowdown_mean": mean(name) / base - 1.0,
            "slowdown_tail": s[f"{tail}_s"] / bench.summarize(record["none"]["steps"])[f"{tail}_s"] - 1.0,
            "cost_s": cost,
            "floor_ratio": bench.ratio(mean(name), floor) if name != "none" else None,
            "cost_over_floor": bench.ratio(cost, floor - base)
            if name not in ("none", "floor") and floor > base
            else None,
            "samples_s": r["steps"],
            "drains_s": r["drains"],
        }
    return out


# ------------------------------------------------------------------------------------------------------ restore
def _write_and_die(cfg: dict[str, Any], root: str, shm: str, steps: int) -> None:
    """A training process that snapshots ``steps`` steps (the last one persisted to disk too) and ends without
    cleaning up, as a killed one would."""
    from lightning_resilience.checkpoint import CheckpointManager, LocalTier, MemoryTier

    wl = GPTWorkload(cfg, batch_size=1)
    memory = MemoryTier(every_n_steps=1, keep=2, shared_memory=True, shm_dir=shm, run_id="restore")
    manager = CheckpointManager([memory, LocalTier(f"{root}/disk", every_n_steps=steps, keep=1)])
    manager.setup()
    for step in range(1, steps + 1):
        wl.step()
        manager.on_step(step, wl.state)
    manager.wait_snapshot()
    manager.wait()


def _restore_seconds(root: Path, shm: Path, source: str) -> tuple[float, int | None]:
    from lightning_resilience.checkpoint import CheckpointManager, LocalTier, MemoryTier

    tiers: list[Any] = (
        [MemoryTier(keep=2, shared_memory=True, shm_dir=str(shm), run_id="restore")]
        if source == "shared memory"
        else [LocalTier(root / "disk", keep=1)]
    )
    manager = CheckpointManager(tiers)
    start = time.perf_counter()
    manager.setup()
    restored = manager.restore()
    seconds = time.perf_counter() - start
    manager.close()
    return seconds, restored.step if restored is not None else None


def run_restore(cfg: dict[str, Any], root: Path, shm: Path, reps: int, steps: int = 3) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")  # a process of its own, gone before the restores
    writer = ctx.Process(target=_write_and_die, args=(cfg, str(root), str(shm), steps))
    writer.start()
    writer.join(600)
    if writer.exitcode != 0:
        raise RuntimeError(f"the writing process failed (exit code {writer.exitcode})")
    out: dict[str, Any] = {}
    for source in ("shared memory", "local disk"):
        _restore_seconds(root, shm, source)  # warm: page cache, imports, the first mapping
        runs = [_restore_seconds(root, shm, source) for _ in range(reps)]
        assert all(step == steps for _, step in runs), f"{source} restored {runs}, not step {steps}"
        out[source] = bench.summarize([s for s, _ in runs])
    out["speedup"] = bench.ratio(out["local disk"]["median_s"], out["shared memory"]["median_s"])
    return out


# --------------------------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--preset", choices=["tiny", "small"], default="small", help="model size")
    p.add_argument("--turn", type=int, default=DISK_EVERY, help="steps per contender turn")
    p.add_argument("--rounds", type=int, default=None, help="turns per contender (default 12; quick: 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per contender first (default 12)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    p.add_argument("--restore-reps", type=int, default=None, help="repetitions per restore figure (default 7)")
    p.add_argument("--tmpdir", default=None, help="where the disk checkpoints go (default: the temp dir)")
    p.add_argument("--shm-dir", default=SHM_DIR,
                   help=f"where the shared buffers go, as the tier's shm_dir (default {SHM_DIR}, a tmpfs)")  # fmt: skip
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    p.add_argument("--quick", action="store_true", help="smoke mode: few steps, nothing to publish")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 12)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 12)
    args.restore_reps = args.restore_reps or (2 if args.quick else 7)
    return args


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from lightning_resilience.checkpoint.filesystems import RAM_FILESYSTEMS, filesystem_type
    from recipes._gpt import gpt_preset

    torch.set_num_threads(args.threads)
    cfg = dict(gpt_preset(args.preset))
    # the shared buffers where a job keeps them (a RAM filesystem): in a directory on a disk the kernel would write
    # each step's pages back to it, and the steps would wait on the writeback
    shm_fs = filesystem_type(Path(args.shm_dir))
    if shm_fs is not None and shm_fs not in RAM_FILESYSTEMS:
        raise SystemExit(f"--shm-dir {args.shm_dir} is on a {shm_fs} filesystem, not in RAM: name a tmpfs directory")
    root = Path(tempfile.mkdtemp(prefix="lr-shm-bench-", dir=args.tmpdir))
    shm = Path(tempfile.mkdtemp(prefix="lr-shm-bench-", dir=args.shm_dir))
    machine = bench.machine_info()
    try:
        wl = GPTWorkload(cfg, batch_size=1)
        state_bytes = sum(t.numel() * t.element_size() for t in _tensors(wl))
        bench.print_flush(f"[{MODULE}] {args.preset}: {state_bytes / 1e6:.0f} MB of state, {args.rounds} rounds")
        contenders: list[_Contender] = [_Contender("none"), _Floor(wl)]
        for name in CONTENDERS[2:]:
            contenders.append(_Engine(name, wl, root / name, shm, shared="shared" in name, disk="disk" in name))
        times = _rotation(wl, contenders, warmup=args.warmup, turn=args.turn, rounds=args.rounds)
        for c in contenders:
            c.close()
        step_time = _figures(times)
        restore = run_restore(cfg, root / "restore", shm / "restore", args.restore_reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    machine["loadavg_at_end"] = list(os.getloadavg())
    same_copy = bench.ratio(step_time["shared"]["mean_s"], step_time["process"]["mean_s"])  # costs what today's costs
    at_floor = step_time["shared+disk"]["floor_ratio"]
    return {
        "benchmark": "shared_memory",
        "title": TITLE,
        "date": bench.now_iso(),
        "command": bench.command_line(MODULE, argv),
        "quick": args.quick,
        "machine": machine,
        "config": {
            "preset": args.preset,
            "state_bytes": state_bytes,
            "turn": args.turn,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "threads": args.threads,
            "shm_dir": args.shm_dir,
            "shm_filesystem": shm_fs,
            "disk_filesystem": filesystem_type(root.parent),
        },
        "step_time": step_time,
        "restore": restore,
        "targets": [
            bench.target("shared snapshot / in-process snapshot, mean step time", same_copy, "<=", 1.02, "x"),
            bench.target("shared snapshot + disk every 10 / floor, mean step time", at_floor, "<=", 1.2, "x"),
            bench.target("restore: local disk / shared memory", restore["speedup"], ">=", 1.0, "x"),
        ],
    }


def _tensors(wl: GPTWorkload) -> list[torch.Tensor]:
    from lightning_resilience.checkpoint.tree import flatten_state

    return list(flatten_state(wl.state()).tensors.values())


def render_markdown(result: dict[str, Any]) -> str:
    st, rs, cfg = result["step_time"], result["restore"], result["config"]
    rows = []
    for name, f in st.items():
        floor = "-" if f["floor_ratio"] is None else f"{f['floor_ratio']:.3f}x"
        tail = f"{bench.fmt_ms(f[f['tail'] + '_s'])} ({f['tail']})"
        mean, median = bench.fmt_ms(f["mean_s"]), bench.fmt_ms(f["median_s"])
        rows.append([name, mean, median, tail, f"{f['slowdown_mean'] * 100:+.1f}%", floor])
    sources = ("shared memory", "local disk")
    restore_rows = [[s, bench.fmt_ms(rs[s]["median_s"]), bench.fmt_ms(rs[s]["min_s"]), rs[s]["n"]] for s in sources]
    what = f"{cfg['state_bytes'] / 1e6:.0f} MB of state, {cfg['rounds']} interleaved turns of {cfg['turn']} steps"
    if cfg.get("shm_filesystem"):
        what += f"; shared buffers in {cfg['shm_dir']} ({cfg['shm_filesystem']})"
        what += f", disk checkpoints on {cfg['disk_filesystem']}"
    return "\n".join(
        [
            f"## {TITLE}",
            "",
            f"`{result['command']}` ({result['date']}; {what}; {bench.load_note(result)}).",
            "",
            bench.md_table(["contender", "mean", "median", "tail", "slowdown (mean)", "step / floor step"], rows),
            "",
            f"Restore of the newest step by a new process: shared memory {rs['speedup']:.1f}x faster than local disk."
            if rs.get("speedup")
            else "",
            "",
            bench.md_table(["restored from", "median", "min", "runs"], restore_rows),
            "",
            bench.targets_table(result["targets"]),
            "",
        ]
    )


def readme_summary(result: dict[str, Any]) -> str:
    st, rs = result["step_time"], result["restore"]
    shared, process, floor = (st[k]["slowdown_mean"] * 100 for k in ("shared", "process", "floor"))
    return (
        f"**snapshots in shared memory** ({result['config']['state_bytes'] / 1e6:.0f} MB of state, CPU): "
        f"{shared:+.1f}% mean step time against {process:+.1f}% in process memory and {floor:+.1f}% for a bare copy "
        f"(the floor); with the disk every 10 steps {st['shared+disk']['floor_ratio']:.2f}x the floor's step; a new "
        f"process restores from shared memory in {bench.fmt_ms(rs['shared memory']['median_s'])}, {rs['speedup']:.1f}x "
        "faster than from a warm local disk."
    )


def main(argv: Sequence[str] | None = None) -> int:
    return bench.run_and_publish(argv, parse_args, run, render_markdown, DEFAULT_OUT)


if __name__ == "__main__":
    raise SystemExit(main())
