"""How long does checkpointing stop the training thread? Our tiered engine against torch.save, DCP and Lightning.

Run from the repository root::

    python -m benchmarks.checkpoint_blocking                 # small GPT (~23M params, ~280 MB of state), minutes
    python -m benchmarks.checkpoint_blocking --quick --preset tiny   # smoke mode, well under a minute

Everything runs on CPU, in one process, on the same GPT training state, with every baseline measured in the same
run: the machine is shared, so the figures that matter are the RATIOS, not the absolute times. Per checkpointed
step it measures

* blocking on the training thread: ``CheckpointManager.on_step`` (RAM tier every step + local disk tier every K
  steps, persisted by a background thread) with the overlapped copy (parameters and optimizer state copied beside
  the next forward/backward; the next optimizer step waits for it in a pre-hook, and that wait is billed as
  blocking) and without it, ``torch.save``, ``torch.distributed.checkpoint.save``, ``dcp.async_save`` (until it
  returns; the wait on its future before the next save is reported separately), and through Lightning our
  ``TieredCheckpoint`` against ``ModelCheckpoint`` with and without ``AsyncCheckpointIO`` (extra step time against
  a Trainer run without checkpointing);
* the step-time slowdown while our background persist runs: at the realistic cadence (disk every 20 steps,
  amortized over windows holding several persists, split into steps with and without a persist in flight) and in
  the worst case (disk every step), each against interleaved steps without any checkpointing;
* restore time from the RAM tier and from the local disk tier, alone and with ``load_state_dict`` into the live
  model and optimizer.

Medians over repeated steps, warm-up excluded. Raw samples, ratios, PASS/MISS per target and machine facts go to
the JSON file named by ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import (
    GPTWorkload,
    command_line,
    evict_page_cache,
    fmt_ms,
    fmt_pct,
    fmt_ratio,
    machine_info,
    md_table,
    now_iso,
    print_flush,
    ratio,
    summarize,
    target,
    write_json,
)

MODULE = "benchmarks.checkpoint_blocking"
DEFAULT_OUT = "benchmarks/results/checkpoint.json"
TITLE = "Checkpoint blocking, persist slowdown and restore"

# the goals of docs/benchmarks.md (see /work/shared/reference/papers.md, goals G1-G4)
TARGET_VS_TORCH_SAVE = 20.0
TARGET_VS_ASYNC_SAVE = 5.0
TARGET_BLOCKING_FRACTION = 0.01
TARGET_PERSIST_SLOWDOWN = 0.05
TARGET_RESTORE_SPEEDUP = 10.0

LOCAL_TIER_DEFAULT_EVERY = 20  # LocalTier(every_n_steps=20): the realistic cadence of the persist figure

pc = time.perf_counter


# ---------------------------------------------------------------------------------------------------- workload
class Workload(GPTWorkload):
    """The AdamW workload; every contender checkpoints model and optimizer state (the schedule is Python-only)."""

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


def tensor_bytes(obj: Any, *, dedupe: bool) -> int:
    """Bytes of all tensors in a nested state (``dedupe``: count a shared storage once, as torch.save does)."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def walk(o: Any) -> None:
        nonlocal total
        if isinstance(o, torch.Tensor):
            key = (o.untyped_storage().data_ptr(), o.storage_offset())
            if dedupe and key in seen:
                return
            seen.add(key)
            total += o.numel() * o.element_size()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, list | tuple):
            for v in o:
                walk(v)

    walk(obj)
    return total


def settle() -> None:
    """Between scenarios: free memory and flush dirty pages so one contender's writeback does not bill the next."""
    gc.collect()
    os.sync()


def loadavg() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


@contextlib.contextmanager
def scenario(name: str, log: dict[str, Any]) -> Iterator[None]:
    print_flush(f"[checkpoint] {name} ...")
    start = pc()
    before = loadavg()
    yield
    log[name] = {"wall_s": pc() - start, "loadavg_before": before, "loadavg_after": loadavg()}
    print_flush(f"[checkpoint] {name} done in {pc() - start:.1f}s")


# ------------------------------------------------------------------------------------- plain-loop contenders
class Contender:
    """One way of checkpointing a step. ``save`` runs right after a training step and returns
    ``(blocking_s, wait_s, persist_step)``; work it does outside those two timings (deleting old files) is not
    billed. ``begin`` runs before each block of steps, ``drain`` untimed at the end of each block so no background
    work spills into the next block. A contender that blocks inside the next training step (our optimizer pre-hook)
    reports that time through ``take_hook_wait``."""

    name = ""
    warmup = 0  # extra warm-up steps this contender needs (0: the global --warmup)
    overlapped = False  # part of its blocking happens inside the next step (see take_hook_wait)

    def begin(self) -> None:
        return None

    def save(self, step: int) -> tuple[float, float, bool]:
        return 0.0, 0.0, False

    def take_hook_wait(self) -> float:
        """Seconds the training thread waited for this contender inside the step just run (then reset)."""
        return 0.0

    def drain(self) -> None:
        return None

    def close(self) -> dict[str, Any]:
        return {}


class NoCheckpoint(Contender):
    name = "none"


class FloorCopy(Contender):
    """The floor of any host snapshot: ``copy_`` of the same tensors into buffers allocated once."""

    name = "floor_copy"

    def __init__(self, wl: Workload) -> None:
        from lightning_resilience.checkpoint.tree import flatten_state

        self._flatten = flatten_state
        self.wl = wl
        self.buffers = {n: t.clone() for n, t in flatten_state(wl.state()).tensors.items()}

    def save(self, step: int) -> tuple[float, float, bool]:
        t0 = pc()
        for name, src in self._flatten(self.wl.state()).tensors.items():
            self.buffers[name].copy_(src)
        return pc() - t0, 0.0, False

    def close(self) -> dict[str, Any]:
        self.buffers.clear()
        return {}


def optimizer_owned(wl: Workload) -> Callable[[torch.Tensor], bool]:
    """Storages of the parameters and the optimizer state: they change only inside ``optimizer.step`` (the same
    predicate ``TieredCheckpoint`` builds, see ``_changed_only_by_optimizer``)."""
    from lightning_resilience.checkpoint.tree import storage_ptr

    storages = {storage_ptr(p) for p in wl.model.parameters()}
    for state in wl.opt.state.values():
        storages.update(storage_ptr(v) for v in state.values() if isinstance(v, torch.Tensor))
    storages.discard(0)
    return lambda t: storage_ptr(t) in storages


class Ours(Contender):
    """``CheckpointManager([MemoryTier(every_n_steps=1, keep=2), LocalTier(root, every_n_steps=K)])``; with
    ``every=None`` the RAM tier only (the engine's own cost, with no background write competing).

    With ``overlap`` (the engine's default through ``TieredCheckpoint``) parameters and optimizer state are copied by
    the engine's background copier while the next forward/backward runs, and an optimizer step pre-hook waits for
    that copy (what ``CheckpointManager.guard_optimizer`` registers; ours times the wait). Blocking = the time inside
    ``on_step`` + the time the next step waits in that hook."""

    def __init__(
        self, name: str, wl: Workload, root: Path, every: int | None, keep: int = 3, *, overlap: bool = True
    ) -> None:
        from lightning_resilience.checkpoint import CheckpointManager, LocalTier, MemoryTier

        self.name = name
        self.wl = wl
        self.root = root
        self.every = every
        self.overlapped = overlap
        tiers: list[Any] = [MemoryTier(every_n_steps=1, keep=2)]
        if every is not None:
            tiers.append(LocalTier(root, every_n_steps=every, keep=keep))
            # one full persist cycle (and the host slots it needs) happens inside the warm-up
            self.warmup = every + 3
        self.mgr = CheckpointManager(tiers)
        self.mgr.setup()
        self._hook: Any = None
        self._hook_wait = 0.0
        self.mark()

    def _local(self) -> tuple[int, int, float]:
        local = self.mgr.stats.tiers.get("local")
        return (local.writes, local.deferred, local.seconds) if local else (0, 0, 0.0)

    def mark(self) -> None:
        """Start counting the local tier's writes from here (after the warm-up)."""
        self._base = self._local()

    def _pre_hook(self, *_: Any) -> None:
        t0 = pc()
        self.mgr.wait_snapshot()
        self._hook_wait += pc() - t0

    def begin(self) -> None:
        # registered only while this contender trains, so no other contender's step runs it
        if self.overlapped and self._hook is None:
            self._hook = self.wl.opt.register_step_pre_hook(self._pre_hook)

    def take_hook_wait(self) -> float:
        wait, self._hook_wait = self._hook_wait, 0.0
        return wait

    def save(self, step: int) -> tuple[float, float, bool]:
        t0 = pc()
        # the predicate is rebuilt every step, inside the timing, as TieredCheckpoint does
        self.mgr.on_step(step, self.wl.state, overlap=optimizer_owned(self.wl) if self.overlapped else None)
        return pc() - t0, 0.0, self.every is not None and step % self.every == 0

    def drain(self) -> None:
        self.mgr.wait_snapshot()
        self.mgr.wait()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._hook_wait = 0.0

    def close(self) -> dict[str, Any]:
        self.drain()
        writes, deferred, seconds = (now - base for now, base in zip(self._local(), self._base))
        return {
            "persist_every": self.every,
            "overlap": self.overlapped,
            "state_bytes": self.mgr.stats.state_bytes,
            "host_bytes": self.mgr.stats.host_bytes,
            "local_writes": writes,
            "local_deferred": deferred,
            "local_write_seconds": seconds,
            "local_write_mean_s": seconds / writes if writes else None,
        }


class TorchSave(Contender):
    """``torch.save(state, file)`` (no fsync: its default); the two newest files are kept."""

    name = "torch_save"

    def __init__(self, wl: Workload, root: Path) -> None:
        self.wl = wl
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.paths: list[Path] = []

    def save(self, step: int) -> tuple[float, float, bool]:
        path = self.root / f"step_{step:06d}.pt"
        t0 = pc()
        torch.save(self.wl.state(), path)
        dt = pc() - t0
        self.paths.append(path)
        while len(self.paths) > 2:
            self.paths.pop(0).unlink()
        return dt, 0.0, False

    def drain(self) -> None:
        os.sync()  # the kernel's writeback of these files must not slow the next contender down

    def close(self) -> dict[str, Any]:
        # context for the restore table: loading the newest file back
        newest = self.paths[-1]
        warm, cold = [], []
        for _ in range(2):
            t0 = pc()
            torch.load(newest, weights_only=True)
            warm.append(pc() - t0)
            evict_page_cache(self.root)
            t0 = pc()
            torch.load(newest, weights_only=True)
            cold.append(pc() - t0)
        return {
            "file_bytes": newest.stat().st_size,
            "torch_load_warm": summarize(warm),
            "torch_load_cold": summarize(cold),
        }


class DcpSave(Contender):
    """``dcp.save(state, no_dist=True)`` into a fresh directory (FileSystemWriter fsyncs by default)."""

    name = "dcp_save"

    def __init__(self, wl: Workload, root: Path) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.wl = wl
        self.root = root
        self.dirs: list[Path] = []

    def save(self, step: int) -> tuple[float, float, bool]:
        path = self.root / f"step_{step:06d}"
        t0 = pc()
        self.dcp.save(self.wl.state(), checkpoint_id=path, no_dist=True)
        dt = pc() - t0
        self.dirs.append(path)
        while len(self.dirs) > 2:
            shutil.rmtree(self.dirs.pop(0))
        return dt, 0.0, False


class DcpAsyncSave(Contender):
    """``dcp.async_save``: blocking is the time until it returns; the wait on the previous save's future (right
    before the next save, after a training step ran in between) is returned separately."""

    name = "dcp_async_save"

    def __init__(self, wl: Workload, root: Path) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.wl = wl
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.dirs: list[Path] = []
        self.pending: Any = None
        self.mode = "no_dist=True (no process group)"
        self.own_group = False
        self.drains: list[float] = []

    def _submit(self, path: Path) -> Any:
        if not self.own_group:
            try:
                return self.dcp.async_save(self.wl.state(), checkpoint_id=path, no_dist=True)
            except (RuntimeError, ValueError, TypeError, AssertionError):
                import torch.distributed as dist

                store = dist.FileStore(str(self.root / "pg_store"), 1)
                dist.init_process_group("gloo", store=store, rank=0, world_size=1)
                self.own_group = True
                self.mode = "1-rank gloo group (FileStore)"
        return self.dcp.async_save(self.wl.state(), checkpoint_id=path)

    def save(self, step: int) -> tuple[float, float, bool]:
        wait = 0.0
        if self.pending is not None:
            t0 = pc()
            self.pending.result()
            wait = pc() - t0
            self.pending = None
        path = self.root / f"step_{step:06d}"
        t0 = pc()
        resp = self._submit(path)
        dt = pc() - t0
        self.pending = getattr(resp, "upload_completion", resp)  # AsyncSaveResponse (custom stager) or a Future
        self.dirs.append(path)
        while len(self.dirs) > 2:  # all but the newest are complete: their futures were waited on
            shutil.rmtree(self.dirs.pop(0), ignore_errors=True)
        return dt, wait, False

    def drain(self) -> None:
        if self.pending is not None:
            t0 = pc()
            self.pending.result()
            self.drains.append(pc() - t0)
            self.pending = None

    def close(self) -> dict[str, Any]:
        self.drain()
        if self.own_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        return {"mode": self.mode, "drain_at_block_end": summarize(self.drains)}


def run_rotation(wl: Workload, contenders: list[Contender], warmup: int, block: int, rounds: int) -> dict[str, Any]:
    """Every contender takes ``block`` steps in turn, ``rounds`` times (order reversed every other round), so all of
    them see the same (shared, drifting) machine. The training state is the same model, trained on throughout.

    Per checkpointed step ``n``: ``blocking`` = the contender's time in ``save(n)`` + the time step ``n + 1`` waited
    in its optimizer pre-hook for snapshot ``n``'s background copy (``hook_wait``); ``compute`` excludes that wait,
    so ``iteration`` = compute + blocking + wait adds up to the wall time. After the last step of a block an
    overlapped contender runs one more (unrecorded) training step, so the last snapshot's wait is measured too."""
    rec: dict[str, dict[str, list[float]]] = {
        c.name: {
            "compute": [],
            "blocking": [],
            "on_step": [],
            "hook_wait": [],
            "wait": [],
            "iteration": [],
            "persist_blocking": [],
            "persist_flag": [],
            "wall": [],
        }
        for c in contenders
    }
    steps = dict.fromkeys(rec, 0)
    pending: dict[str, int | None] = dict.fromkeys(rec)  # index of the sample whose copy the next step waits for

    def bill_hook_wait(c: Contender) -> float:
        waited = c.take_hook_wait()
        i = pending[c.name]
        if i is not None:
            r = rec[c.name]
            r["hook_wait"][i] += waited
            r["blocking"][i] += waited
            r["iteration"][i] += waited
            pending[c.name] = None
        return waited

    def one(c: Contender, record: bool) -> None:
        steps[c.name] += 1
        t0 = pc()
        wl.step()
        compute = pc() - t0
        compute -= bill_hook_wait(c) if record else c.take_hook_wait()
        blocking, wait, persist_step = c.save(steps[c.name])
        if record:
            r = rec[c.name]
            r["compute"].append(compute)
            r["on_step"].append(blocking)
            r["hook_wait"].append(0.0)
            r["blocking"].append(blocking)
            r["wait"].append(wait)
            r["iteration"].append(compute + blocking + wait)
            r["persist_flag"].append(float(persist_step))
            pending[c.name] = len(r["blocking"]) - 1

    for c in contenders:
        c.begin()
        for _ in range(max(warmup, c.warmup)):
            one(c, record=False)
        c.drain()
        if isinstance(c, Ours):
            c.mark()
    for i in range(rounds):
        for c in contenders if i % 2 == 0 else contenders[::-1]:
            c.begin()
            start = pc()
            for _ in range(block):
                one(c, record=True)
            rec[c.name]["wall"].append(pc() - start)
            if c.overlapped:
                wl.step()  # the step that waits for the block's last background copy
            bill_hook_wait(c)
            c.drain()
    for r in rec.values():
        r["persist_blocking"] = [b for b, flag in zip(r["blocking"], r["persist_flag"]) if flag]
    return rec


def run_cadence(wl: Workload, root: Path, every: int, persists: int, rounds: int, warmup: int) -> dict[str, Any]:
    """The realistic cadence: RAM tier every step, local disk tier every ``every`` steps (the LocalTier default),
    overlapped copy. Windows of ``every * persists`` steps with our engine alternate with windows of as many steps
    without checkpointing (A B B A ...). Each of our windows starts with a persist step, so it holds exactly
    ``persists`` complete persists and the amortized mean step time over all our windows (``rounds * persists``
    persists) covers all their cost. Short windows, many pairs: the shared machine's drift cancels better than with
    a few long windows. A step counts as "persist in flight" when a persist started earlier had not finished when
    the step began."""
    ours = Ours("ours_cadence", wl, root, every, overlap=True)
    local = ours.mgr.stats.tiers["local"]
    window = every * persists
    none_it: list[float] = []
    it: list[float] = []
    inflight: list[bool] = []
    blocking: list[float] = []
    hook: list[float] = []
    walls = {"none": 0.0, "ours": 0.0}

    def ours_step(step: int, record: bool, state: dict[str, int]) -> None:
        ours.mgr.collect()  # folds finished persists into the tier's counters
        busy = state["started"] > local.writes + local.failures - state["base"]
        t0 = pc()
        wl.step()
        compute = pc() - t0
        waited = ours.take_hook_wait()
        deferred = local.deferred
        t1 = pc()
        ours.mgr.on_step(step, wl.state, overlap=optimizer_owned(wl))
        dt = pc() - t1
        state["due"] = int(state["due"] or step % every == 0)  # a deferred persist is retried on the next step
        if state["due"] and local.deferred == deferred:
            state["started"] += 1
            state["due"] = 0
        if record:
            if len(hook) > state["mark"]:  # the wait in this step is for the previous step's copy
                hook[-1] += waited
                blocking[-1] += waited
                it[-1] += waited
                waited = 0.0
            it.append(compute - waited + dt)
            inflight.append(busy)
            blocking.append(dt)
            hook.append(0.0)

    def fresh_state() -> dict[str, int]:
        return {"started": 0, "due": 0, "base": local.writes + local.failures, "mark": len(hook)}

    ours.begin()
    warm = fresh_state()
    for step in range(every - 2, every + 4):  # includes one persist: host slots and files exist afterwards
        ours_step(step, False, warm)
    ours.drain()
    for _ in range(warmup):
        wl.step()
    ours.mark()
    next_step = 2 * every  # every window starts on a persist step
    order = ["none", "ours"]
    for r in range(rounds):
        for kind in order if r % 2 == 0 else order[::-1]:
            start = pc()
            if kind == "none":
                for _ in range(window):
                    t0 = pc()
                    wl.step()
                    none_it.append(pc() - t0)
            else:
                ours.begin()
                state = fresh_state()
                for _ in range(window):
                    ours_step(next_step, True, state)
                    next_step += 1
                wl.step()  # waits for the window's last background copy: billed to the window's last step
                waited = ours.take_hook_wait()
                if len(hook) > state["mark"]:
                    hook[-1] += waited
                    blocking[-1] += waited
                    it[-1] += waited
                ours.drain()  # every persist of the window finished well before its end; this is not billed
            walls[kind] += pc() - start
            gc.collect()
    details = ours.close()
    ours.mgr.close()
    base_mean = statistics.fmean(none_it) if none_it else None
    busy_it = [x for x, b in zip(it, inflight) if b]
    idle_it = [x for x, b in zip(it, inflight) if not b]
    # per pair of adjacent windows (none, ours): how much the figure moves with the machine's drift
    pairs = [
        statistics.fmean(it[i * window : (i + 1) * window]) / statistics.fmean(none_it[i * window : (i + 1) * window])
        - 1.0
        for i in range(rounds)
        if it[i * window : (i + 1) * window] and none_it[i * window : (i + 1) * window]
    ]

    def slow(xs: list[float]) -> float | None:
        return None if not xs or not base_mean else statistics.fmean(xs) / base_mean - 1.0

    return {
        "persist_every": every,
        "persists_per_window": persists,
        "window_steps": window,
        "rounds": rounds,
        "baseline_iteration": summarize(none_it),
        "iteration": summarize(it),
        "iteration_persist_in_flight": summarize(busy_it),
        "iteration_no_persist_in_flight": summarize(idle_it),
        "blocking": summarize(blocking),
        "hook_wait": summarize(hook),
        "slowdown_mean": slow(it),
        "slowdown_median": statistics.median(it) / statistics.median(none_it) - 1.0 if it and none_it else None,
        "slowdown_in_flight_mean": slow(busy_it),
        "slowdown_no_persist_mean": slow(idle_it),
        "slowdown_per_window_pair": pairs,
        "slowdown_per_window_pair_median": statistics.median(pairs) if pairs else None,
        "blocking_persist_in_flight": summarize(x for x, b in zip(blocking, inflight) if b),
        "blocking_no_persist_in_flight": summarize(x for x, b in zip(blocking, inflight) if not b),
        "steps_in_flight": len(busy_it),
        "local_writes": details["local_writes"],
        "local_deferred": details["local_deferred"],
        "local_write_mean_s": details["local_write_mean_s"],
        "walls_s": walls,
    }


def measure_restore(mgr: Any, wl: Workload, root: Path, every: int, reps: int) -> dict[str, Any]:
    """``CheckpointManager.restore``: from the manager that holds the RAM tier, and from fresh managers that only
    have the local disk tier (page cache warm, and after evicting the files' cached pages); interleaved.

    A RAM restore hands the snapshot's buffers over (``MemoryTier.take``): the step leaves the RAM tier. So before
    each RAM repetition the manager takes one fresh, untimed snapshot of the live state (a step number off the disk
    cadence, so the disk tier is unchanged). Each restore is then applied to the live model and optimizer
    (``load_state_dict``), timed separately: restore + apply is what a user pays."""
    from lightning_resilience.checkpoint import CheckpointManager, LocalTier

    def apply(state: dict[str, Any]) -> float:
        t0 = pc()
        wl.model.load_state_dict(state["model"])
        wl.opt.load_state_dict(state["optim"])
        return pc() - t0

    def from_disk(cold: bool) -> tuple[float, float, int]:
        fresh = CheckpointManager([LocalTier(root, every_n_steps=every)])
        fresh.setup()
        if cold:
            evict_page_cache(root)
        t0 = pc()
        res = fresh.restore()
        dt = pc() - t0
        fresh.close()
        if res is None or res.tier != "local":
            raise RuntimeError(f"expected a restore from the local tier, got {res and res.tier}")
        return dt, apply(res.state), res.step

    next_step = max((s for tier in mgr.tiers for s in tier.list_steps()), default=0) + 1

    def fresh_snapshot() -> int:
        nonlocal next_step
        if next_step % every == 0:
            next_step += 1
        step, next_step = next_step, next_step + 1
        mgr.on_step(step, wl.state)
        mgr.wait_snapshot()
        mgr.wait()
        return step

    ram, warm, cold = [], [], []
    ram_apply, warm_apply, cold_apply = [], [], []
    ram_step = disk_step = None
    from_disk(cold=False)  # the first read after the writes: not a figure
    for _ in range(reps):
        expected = fresh_snapshot()
        gc.collect()
        t0 = pc()
        res = mgr.restore()
        ram.append(pc() - t0)
        if res is None or res.tier != "memory" or res.step != expected:
            raise RuntimeError(f"expected step {expected} from the memory tier, got {res and (res.step, res.tier)}")
        ram_apply.append(apply(res.state))
        ram_step = res.step
        del res
        gc.collect()
        dt, da, disk_step = from_disk(cold=False)
        warm.append(dt)
        warm_apply.append(da)
        gc.collect()
        dt, da, _ = from_disk(cold=True)
        cold.append(dt)
        cold_apply.append(da)
    return {
        "ram": summarize(ram),
        "ram_step": ram_step,
        "disk_warm": summarize(warm),
        "disk_cold": summarize(cold),
        "disk_step": disk_step,
        "ram_apply": summarize(ram_apply),
        "disk_warm_apply": summarize(warm_apply),
        "disk_cold_apply": summarize(cold_apply),
        "ram_total": summarize(a + b for a, b in zip(ram, ram_apply)),
        "disk_warm_total": summarize(a + b for a, b in zip(warm, warm_apply)),
        "disk_cold_total": summarize(a + b for a, b in zip(cold, cold_apply)),
        "verify_checksums": True,
        "ram_restore": "MemoryTier.take: the snapshot buffers are handed over, no copy",
    }


# --------------------------------------------------------------------------------------------- Lightning runs
def _lightning_quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_resilience"):
        logging.getLogger(name).setLevel(logging.WARNING)


_STEP_RE = re.compile(r"step=(\d+)")


def run_lightning(
    kind: str,
    model_kwargs: dict[str, Any],
    batch_size: int,
    root: Path,
    steps: int,
    warmup: int,
    every: int,
    threads: int,
) -> dict[str, Any]:
    """One Trainer run; per-step time is the interval between consecutive ``on_train_batch_start`` hooks, so it
    includes every callback's work (ModelCheckpoint always runs last)."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_resilience.checkpoint import LocalTier, MemoryTier
    from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint
    from recipes._data import SyntheticTokenDataModule
    from recipes._gpt import TinyGPT

    ckpt_dir = root / "ckpt"
    tiered = None
    callbacks: list[Any] = []
    plugins: list[Any] = []
    if kind == "tiered":
        tiered = TieredCheckpoint(
            tiers=[MemoryTier(every_n_steps=1, keep=2), LocalTier(ckpt_dir, every_n_steps=every)], resume="never"
        )
        callbacks.append(tiered)
    elif kind in ("modelcheckpoint", "modelcheckpoint_async"):
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_last=False, save_top_k=-1))
        if kind == "modelcheckpoint_async":
            plugins.append(AsyncCheckpointIO())
    elif kind != "none":
        raise ValueError(kind)

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.cleanup: list[float] = []
            self.captures: list[float] = []
            self._seen = 0
            self.end = 0.0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            torch.set_num_threads(threads)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            t0 = pc()
            # keep the disk bounded for ModelCheckpoint(save_top_k=-1): drop all but the two newest files; the time
            # this takes is subtracted from the interval it falls into
            if kind.startswith("modelcheckpoint") and ckpt_dir.is_dir():
                files = sorted(
                    ckpt_dir.glob("*.ckpt"), key=lambda p: int(m.group(1)) if (m := _STEP_RE.search(p.name)) else -1
                )
                for old in files[:-2]:
                    with contextlib.suppress(FileNotFoundError):
                        old.unlink()
            if tiered is not None and tiered.manager is not None and tiered.manager.stats.captures > self._seen:
                self._seen = tiered.manager.stats.captures
                self.captures.append(tiered.manager.stats.last_capture_seconds)
            now = pc()
            self.cleanup.append(now - t0)
            self.starts.append(now)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.end = pc()

    timer = StepTimer()
    torch.manual_seed(0)
    model = TinyGPT(**model_kwargs)
    total = warmup + steps + 1
    data = SyntheticTokenDataModule(
        batch_size=batch_size,
        num_samples=batch_size * (total + 2),
        seq_len=model_kwargs["seq_len"],
        vocab_size=model_kwargs["vocab_size"],
        seed=1,
    )
    trainer = Trainer(
        max_steps=total,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=kind.startswith("modelcheckpoint"),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=root,
        callbacks=[timer, *callbacks],
        plugins=plugins or None,
    )
    fit_start = pc()
    trainer.fit(model, datamodule=data)
    fit_end = pc()
    intervals = [(timer.starts[i + 1] - timer.starts[i]) - timer.cleanup[i + 1] for i in range(len(timer.starts) - 1)][
        warmup:
    ]
    out: dict[str, Any] = {
        "kind": kind,
        "step_interval": summarize(intervals),
        "fit_wall_s": fit_end - fit_start,
        # after the last step: drain of background saves (AsyncCheckpointIO's queue, our in-flight persist)
        "after_last_step_s": fit_end - (timer.starts[-1] if timer.starts else fit_start),
        "torch_threads": torch.get_num_threads(),
    }
    if tiered is not None:
        assert tiered.manager is not None
        out["tiered_capture"] = summarize(timer.captures[warmup:])
        out["tiered_summary"] = tiered.summary()
        out["state_bytes"] = tiered.manager.stats.state_bytes
    del trainer, model, data
    return out


# ------------------------------------------------------------------------------------------------------ driver
def model_config(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    from recipes._gpt import gpt_preset

    cfg = gpt_preset(args.preset)
    notes = []
    for key in ("d_model", "n_layer"):
        value = getattr(args, key)
        if value is not None and value != cfg[key]:
            notes.append(f"{key} changed from {cfg[key]} to {value} (--{key.replace('_', '-')})")
            cfg[key] = value
    return cfg, notes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=["tiny", "small"], default="small", help="TinyGPT size preset")
    p.add_argument("--steps", type=int, default=None, help="measured steps per contender (default 20; quick: 4)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps excluded from figures (default 5)")
    p.add_argument("--block", type=int, default=None, help="steps per contender turn in the rotation (default 5)")
    p.add_argument(
        "--persist-every", type=int, default=None, help="K: local tier cadence in the rotation (default 5; quick: 2)"
    )
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (rest: background work)")
    p.add_argument("--restore-reps", type=int, default=None, help="repetitions per restore figure (default 5)")
    p.add_argument(
        "--cadence-every", type=int, default=None, help="disk cadence of the realistic-cadence figure (20; quick: 2)"
    )
    p.add_argument("--cadence-persists", type=int, default=None, help="persists per measured window (default 1)")
    p.add_argument(
        "--cadence-rounds",
        type=int,
        default=None,
        help="window pairs (none, ours) of that figure (default 6; quick: 2)",
    )
    p.add_argument("--lightning-passes", type=int, default=None, help="Trainer runs per Lightning contender (2)")
    p.add_argument("--d-model", type=int, default=None, help="override d_model (shrink the state)")
    p.add_argument("--n-layer", type=int, default=None, help="override n_layer (shrink the state)")
    p.add_argument("--tmpdir", default=None, help="where checkpoints are written (default: system temp dir)")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    p.add_argument("--quick", action="store_true", help="smoke mode (<1 min with --preset tiny): few steps")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {
        "steps": (4, 20),
        "warmup": (2, 5),
        "block": (2, 5),
        "persist_every": (2, 5),
        "restore_reps": (2, 5),
        "lightning_passes": (1, 2),
        "cadence_every": (2, 20),
        "cadence_persists": (1, 1),
        "cadence_rounds": (2, 6),
    }
    for name, (q, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, q if quick else full)
    for name in (
        "steps",
        "block",
        "persist_every",
        "restore_reps",
        "batch_size",
        "threads",
        "lightning_passes",
        "cadence_every",
        "cadence_persists",
        "cadence_rounds",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    args.block = min(args.block, args.steps)
    return args


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import lightning.pytorch  # configures its loggers on import: quiet them afterwards

    _lightning_quiet()
    torch.set_num_threads(args.threads)
    machine = machine_info()
    cfg, shrink_notes = model_config(args)
    started = pc()
    walls: dict[str, Any] = {}
    base_tmp = Path(tempfile.mkdtemp(prefix="lr-bench-ckpt-", dir=args.tmpdir))
    warmup, every, block = args.warmup, args.persist_every, args.block
    rounds = math.ceil(args.steps / block)
    try:
        wl = Workload(cfg, args.batch_size)
        wl.step()  # AdamW allocates its state on the first step: from here on the state has its full size
        state = wl.state()
        n_params = sum(p.numel() for p in wl.model.parameters())
        state_bytes = tensor_bytes(state, dedupe=True)
        del state
        print_flush(
            f"[checkpoint] preset={args.preset} params={n_params / 1e6:.2f}M state={state_bytes / 1e6:.1f} MB "
            f"threads={args.threads} batch={args.batch_size} steps={rounds * block} ({rounds}x{block}) "
            f"warmup={warmup} K={every} load={machine['loadavg_at_start']}"
        )
        for note in shrink_notes:
            print_flush(f"[checkpoint] NOTE: {note}")

        with scenario("rotation", walls):
            ours = Ours("ours", wl, base_tmp / "ours", every)
            contenders: list[Contender] = [
                NoCheckpoint(),
                FloorCopy(wl),
                ours,
                Ours("ours_no_overlap", wl, base_tmp / "ours_no_overlap", every, overlap=False),
                Ours("ours_ram_only", wl, base_tmp / "unused", None),
                Ours("ours_every_step", wl, base_tmp / "ours_every", 1, keep=2),
                TorchSave(wl, base_tmp / "torch_save"),
                DcpSave(wl, base_tmp / "dcp_save"),
                DcpAsyncSave(wl, base_tmp / "dcp_async"),
            ]
            rec = run_rotation(wl, contenders, warmup, block, rounds)
            details = {c.name: c.close() for c in contenders if c is not ours}
            details["ours"] = ours.close()
        for c in contenders:
            if isinstance(c, Ours) and c is not ours:
                c.mgr.close()
        settle()
        with scenario("restore", walls):
            restore = measure_restore(ours.mgr, wl, ours.root, every, args.restore_reps)
            ours.mgr.close()
        del contenders, ours
        shutil.rmtree(base_tmp, ignore_errors=True)
        base_tmp.mkdir()
        settle()
        with scenario("cadence", walls):
            cadence = run_cadence(
                wl, base_tmp / "cadence", args.cadence_every, args.cadence_persists, args.cadence_rounds, warmup
            )
        del wl
        shutil.rmtree(base_tmp, ignore_errors=True)
        base_tmp.mkdir()
        settle()

        per_pass = math.ceil(args.steps / args.lightning_passes)
        kinds = ["none", "tiered", "modelcheckpoint", "modelcheckpoint_async"]
        passes: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        with scenario("lightning", walls):
            for i in range(args.lightning_passes):
                for kind in kinds if i % 2 == 0 else kinds[::-1]:
                    root = base_tmp / f"pl_{kind}_{i}"
                    print_flush(f"[checkpoint]   Trainer pass {i + 1}: {kind}")
                    passes[kind].append(
                        run_lightning(kind, cfg, args.batch_size, root, per_pass, warmup, every, args.threads)
                    )
                    shutil.rmtree(root, ignore_errors=True)
                    settle()
    finally:
        shutil.rmtree(base_tmp, ignore_errors=True)

    # ----------------------------------------------------------------------------------------- figures
    lightning = {}
    for kind, runs in passes.items():
        pooled: dict[str, Any] = {
            "step_interval": summarize(x for r in runs for x in r["step_interval"]["samples_s"]),
            "after_last_step_s": [r["after_last_step_s"] for r in runs],
            "fit_wall_s": [r["fit_wall_s"] for r in runs],
            "pass_medians_s": [r["step_interval"]["median_s"] for r in runs],
        }
        if kind == "tiered":
            pooled["tiered_capture"] = summarize(x for r in runs for x in r["tiered_capture"]["samples_s"])
            pooled["tiered_summary"] = [r["tiered_summary"] for r in runs]
        lightning[kind] = pooled
    pl_base = lightning["none"]["step_interval"]["median_s"]
    pl_extra = {
        k: lightning[k]["step_interval"]["median_s"] - pl_base
        for k in ("tiered", "modelcheckpoint", "modelcheckpoint_async")
    }

    blocking = {name: summarize(r["blocking"]) for name, r in rec.items() if name != "none"}
    for name in ("ours", "ours_no_overlap", "ours_ram_only", "ours_every_step"):
        blocking[f"{name}_on_step"] = summarize(rec[name]["on_step"])
        blocking[f"{name}_hook_wait"] = summarize(rec[name]["hook_wait"])
    blocking["ours_persist_steps"] = summarize(rec["ours"]["persist_blocking"])
    blocking["ours_no_overlap_persist_steps"] = summarize(rec["ours_no_overlap"]["persist_blocking"])
    blocking["ours_ram_only_steps"] = summarize(
        b for b, flag in zip(rec["ours"]["blocking"], rec["ours"]["persist_flag"]) if not flag
    )
    blocking["dcp_async_save_wait_previous"] = summarize(rec["dcp_async_save"]["wait"])
    blocking["dcp_async_save_plus_wait"] = summarize(
        b + w for b, w in zip(rec["dcp_async_save"]["blocking"], rec["dcp_async_save"]["wait"])
    )
    iteration = {name: summarize(r["iteration"]) for name, r in rec.items()}
    compute = {name: summarize(r["compute"]) for name, r in rec.items()}
    base_iter = iteration["none"]
    step_time = base_iter["median_s"]
    slowdown = {
        name: {
            "mean": ratio(it["mean_s"], base_iter["mean_s"]) - 1.0,
            "median": ratio(it["median_s"], base_iter["median_s"]) - 1.0,
            "compute_mean": ratio(compute[name]["mean_s"], compute["none"]["mean_s"]) - 1.0,
        }
        for name, it in iteration.items()
    }
    every_details = details["ours_every_step"]
    every_wall = sum(rec["ours_every_step"]["wall"])
    persist = {
        "baseline_iteration": base_iter,
        "persist_iteration": iteration["ours_every_step"],
        "baseline_compute": compute["none"],
        "persist_compute": compute["ours_every_step"],
        "persist_blocking": blocking["ours_every_step"],
        "slowdown_mean": slowdown["ours_every_step"]["mean"],
        "slowdown_median": slowdown["ours_every_step"]["median"],
        "compute_slowdown_mean": slowdown["ours_every_step"]["compute_mean"],
        "local_writes": every_details["local_writes"],
        "local_deferred": every_details["local_deferred"],
        "local_write_mean_s": every_details["local_write_mean_s"],
        "persist_duty_cycle": min(1.0, every_details["local_write_seconds"] / every_wall) if every_wall else None,
        "rounds": rounds,
        "block": block,
        "cadence": cadence,
    }
    ours_block = blocking["ours"]["median_s"]
    ratios = {
        "torch_save_over_ours": ratio(blocking["torch_save"]["median_s"], ours_block),
        "torch_save_over_ours_persist_steps": ratio(
            blocking["torch_save"]["median_s"], blocking["ours_persist_steps"]["median_s"]
        ),
        "dcp_save_over_ours": ratio(blocking["dcp_save"]["median_s"], ours_block),
        "dcp_async_save_over_ours": ratio(blocking["dcp_async_save"]["median_s"], ours_block),
        "dcp_async_save_with_wait_over_ours": ratio(blocking["dcp_async_save_plus_wait"]["median_s"], ours_block),
        "ours_no_overlap_over_ours": ratio(blocking["ours_no_overlap"]["median_s"], ours_block),
        "torch_save_over_ours_no_overlap": ratio(
            blocking["torch_save"]["median_s"], blocking["ours_no_overlap"]["median_s"]
        ),
        "dcp_async_save_over_ours_no_overlap": ratio(
            blocking["dcp_async_save"]["median_s"], blocking["ours_no_overlap"]["median_s"]
        ),
        "ours_no_overlap_blocking_fraction_of_step": ratio(blocking["ours_no_overlap"]["median_s"], step_time),
        "ours_over_floor_copy": ratio(ours_block, blocking["floor_copy"]["median_s"]),
        "ours_ram_only_over_floor_copy": ratio(
            blocking["ours_ram_only"]["median_s"], blocking["floor_copy"]["median_s"]
        ),
        "torch_save_over_floor_copy": ratio(blocking["torch_save"]["median_s"], blocking["floor_copy"]["median_s"]),
        "dcp_async_save_over_floor_copy": ratio(
            blocking["dcp_async_save"]["median_s"], blocking["floor_copy"]["median_s"]
        ),
        "ours_blocking_fraction_of_step": ratio(ours_block, step_time),
        "step_time_for_1pct_blocking_s": ours_block / TARGET_BLOCKING_FRACTION if ours_block else None,
        "persist_slowdown_mean": persist["slowdown_mean"],
        "persist_slowdown_cadence_mean": cadence["slowdown_mean"],
        "persist_slowdown_cadence_in_flight_mean": cadence["slowdown_in_flight_mean"],
        "restore_disk_warm_over_ram": ratio(restore["disk_warm"]["median_s"], restore["ram"]["median_s"]),
        "restore_disk_cold_over_ram": ratio(restore["disk_cold"]["median_s"], restore["ram"]["median_s"]),
        "restore_applied_disk_warm_over_ram": ratio(
            restore["disk_warm_total"]["median_s"], restore["ram_total"]["median_s"]
        ),
        "restore_applied_disk_cold_over_ram": ratio(
            restore["disk_cold_total"]["median_s"], restore["ram_total"]["median_s"]
        ),
        "lightning_modelcheckpoint_over_tiered": ratio(pl_extra["modelcheckpoint"], pl_extra["tiered"]),
        "lightning_modelcheckpoint_async_over_tiered": ratio(pl_extra["modelcheckpoint_async"], pl_extra["tiered"]),
        "lightning_tiered_capture_fraction_of_step": ratio(lightning["tiered"]["tiered_capture"]["median_s"], pl_base),
    }
    targets = [
        target(
            "blocking: torch.save / ours",
            ratios["torch_save_over_ours"],
            ">=",
            TARGET_VS_TORCH_SAVE,
            "x",
            "medians over all checkpointed steps, same rotation; ours = on_step + the optimizer's wait for the copy",
        ),
        target(
            "blocking: dcp.async_save (until it returns) / ours",
            ratios["dcp_async_save_over_ours"],
            ">=",
            TARGET_VS_ASYNC_SAVE,
            "x",
            "the wait on the previous save's future is not counted here",
        ),
        target(
            "blocking / step time (ours)",
            ratios["ours_blocking_fraction_of_step"],
            "<=",
            TARGET_BLOCKING_FRACTION,
            "fraction",
            "RAM snapshot every step; step time: median of the steps without checkpointing",
        ),
        target(
            f"step-time slowdown, disk every {cadence['persist_every']} steps (amortized)",
            ratios["persist_slowdown_cadence_mean"],
            "<=",
            TARGET_PERSIST_SLOWDOWN,
            "fraction",
            f"mean step time over windows of {cadence['window_steps']} steps holding {cadence['persists_per_window']} "
            f"persist{'s' if cadence['persists_per_window'] != 1 else ''} each vs interleaved windows without "
            "checkpointing",
        ),
        target(
            "step-time slowdown, disk every step (worst case)",
            ratios["persist_slowdown_mean"],
            "<=",
            TARGET_PERSIST_SLOWDOWN,
            "fraction",
            "mean iteration time (compute + blocking) vs interleaved blocks without checkpointing",
        ),
        target(
            "restore: disk (warm page cache) / RAM",
            ratios["restore_disk_warm_over_ram"],
            ">=",
            TARGET_RESTORE_SPEEDUP,
            "x",
            "`restore()` alone, warm page cache (the disk's best case); with load_state_dict into the live model "
            f"and optimizer: {fmt_ratio(ratios['restore_applied_disk_warm_over_ram'])}",
        ),
    ]
    total_wall = pc() - started
    machine["loadavg_at_end"] = loadavg()
    return {
        "benchmark": "checkpoint_blocking",
        "title": TITLE,
        "command": command_line(MODULE, argv),
        "date": now_iso(),
        "total_wall_s": total_wall,
        "machine": machine,
        "config": {
            "preset": args.preset,
            "model": cfg,
            "params": n_params,
            "state_bytes": state_bytes,
            "state_bytes_engine": details["ours"]["state_bytes"],
            "batch_size": args.batch_size,
            "threads": args.threads,
            "steps": rounds * block,
            "rounds": rounds,
            "block": block,
            "warmup": warmup,
            "persist_every": every,
            "restore_reps": args.restore_reps,
            "cadence_every": args.cadence_every,
            "cadence_persists": args.cadence_persists,
            "cadence_rounds": args.cadence_rounds,
            "lightning_passes": args.lightning_passes,
            "lightning_steps_per_pass": per_pass,
            "quick": args.quick,
            "shrunk": shrink_notes,
            "tmpdir": args.tmpdir or tempfile.gettempdir(),
        },
        "step_time": {"baseline_median_s": step_time, "baseline": base_iter},
        "blocking": blocking,
        "iteration": iteration,
        "compute": compute,
        "slowdown": slowdown,
        "details": details,
        "persist": persist,
        "restore": {
            **restore,
            "torch_load_warm": details["torch_save"]["torch_load_warm"],
            "torch_load_cold": details["torch_save"]["torch_load_cold"],
        },
        "lightning": {"runs": lightning, "baseline_step_s": pl_base, "extra_step_s": pl_extra},
        "ratios": ratios,
        "targets": targets,
        "scenario_walls": walls,
    }


# ------------------------------------------------------------------------------------------------- rendering
def _med(d: dict[str, Any]) -> float | None:
    return d.get("median_s")


def _x(value: float | None) -> str:
    return fmt_ratio(value)


def _load_note(r: dict[str, Any], scenario: str) -> str:
    walls = r.get("scenario_walls", {}).get(scenario) or {}
    before, after = walls.get("loadavg_before"), walls.get("loadavg_after")
    if not before or not after:
        return ""
    return (
        f" 1-min load average {before[0]:.1f} before and {after[0]:.1f} after this scenario (our trainer and "
        "background threads account for 1 to 2 of it)."
    )


def _pct_range(values: Sequence[float]) -> str:
    return f"{fmt_pct(min(values))} to {fmt_pct(max(values))}" if values else "n/a"


def render_markdown(r: dict[str, Any], *, heading: str = "##") -> str:
    """Markdown tables of one result (also printed to stdout at the end of a run)."""
    cfg, m, b, rt = r["config"], r["machine"], r["blocking"], r["ratios"]
    step = r["step_time"]["baseline_median_s"]
    ours = _med(b["ours"])
    cite = f"*Command:* `{r['command']}` · *Date:* {r['date']} · *Run time:* {r['total_wall_s'] / 60:.1f} min"
    sub = heading + "#"
    load0, load1 = (f"{(m.get(k) or [float('nan')])[0]:.1f}" for k in ("loadavg_at_start", "loadavg_at_end"))
    tied = ": the tied embedding/head weight is copied twice" if cfg["state_bytes_engine"] > cfg["state_bytes"] else ""
    out: list[str] = [f"{heading} {r['title']}", ""]
    out.append(
        f"GPT preset `{cfg['preset']}`: {cfg['params'] / 1e6:.1f}M parameters, AdamW, "
        f"{cfg['state_bytes'] / 1e6:.0f} MB of model+optimizer state ({cfg['state_bytes_engine'] / 1e6:.0f} MB as our "
        f"engine stores it{tied}), batch {cfg['batch_size']} x "
        f"{cfg['model']['seq_len']} tokens, trainer on {cfg['threads']} torch thread(s). Machine: "
        f"{m['cpu_count']} cores ({m['cpu_model']}), {m['mem_total_gib']} GiB RAM, torch {m['torch']}, Lightning "
        f"{m['lightning']}; 1-min load average {load0} at start, {load1} at end (shared machine: read the "
        f"ratios, not the absolute times)."
    )
    out += [
        "",
        f"Method: one training loop; every contender checkpoints {cfg['block']} consecutive steps in turn, "
        f"{cfg['rounds']} rounds (order reversed every other round), after {cfg['warmup']}+ warm-up steps each, so "
        f"all see the same machine. Figures are medians over {cfg['steps']} checkpointed steps per contender. Our "
        f"engine: RAM tier every step, local disk tier every K={cfg['persist_every']} steps (fsync + checksums, "
        "in a background thread). **ours** copies parameters and optimizer state in a background thread while the "
        "next forward/backward runs (`on_step(..., overlap=pred)`, the default of `TieredCheckpoint`); an optimizer "
        "step pre-hook waits for that copy (as `guard_optimizer` does). Its blocking per checkpointed step is the "
        "time inside `on_step` **plus** the time the next step waits in that hook. **ours (no overlap)** copies "
        "everything inside `on_step`.",
    ]
    if cfg["shrunk"]:
        out += ["", "**Model changed:** " + "; ".join(cfg["shrunk"])]
    if cfg["quick"]:
        out += ["", "**Quick (smoke) run: too few steps for the figures to mean much.**"]

    out += ["", f"{sub} Blocking of the training thread per checkpointed step", "", cite, ""]
    rows = []
    slow = r["slowdown"]

    def row(name: str, key: str, note: str, d: dict[str, Any] | None = None, contender: str | None = None) -> None:
        d = d or b[key]
        med = _med(d)
        cont = contender or key
        rows.append(
            [
                name,
                fmt_ms(med),
                fmt_ms(d.get("p90_s")),
                fmt_ms(d.get("max_s")),
                fmt_pct(ratio(med, step)),
                _x(ratio(med, ours)),
                fmt_pct(slow[cont]["mean"]) if cont in slow else "",
                note,
            ]
        )

    row(
        "**ours**: `on_step` + optimizer wait (overlapped copy)",
        "ours",
        "RAM snapshot every step; disk write in background",
    )
    row("ours: inside `on_step`", "ours_on_step", "non-overlapped tensors, bookkeeping", contender="-")
    row(
        "ours: wait in the optimizer pre-hook",
        "ours_hook_wait",
        "the background copy not yet done when the next step reaches optimizer.step",
        contender="-",
    )
    row("ours, steps that start a disk persist", "ours_persist_steps", "", contender="-")
    row(
        "**ours (no overlap)**: `on_step`",
        "ours_no_overlap",
        "the whole copy on the training thread; same tiers",
    )
    row("ours (no overlap), steps that start a disk persist", "ours_no_overlap_persist_steps", "", contender="-")
    row("ours, RAM tier only", "ours_ram_only", "overlapped; no disk write competing")
    row("ours, local tier every step", "ours_every_step", "overlapped; persist deferred while the previous one runs")
    row("context: bare `copy_` into preallocated buffers", "floor_copy", "the floor for any CPU snapshot")
    row("`torch.save` to local disk", "torch_save", "no fsync (its default)")
    row("`dcp.save` (no_dist)", "dcp_save", "FileSystemWriter fsyncs (its default)")
    row("`dcp.async_save` until it returns", "dcp_async_save", r["details"]["dcp_async_save"]["mode"])
    row(
        "`dcp.async_save`: wait on the previous future",
        "dcp_async_save_wait_previous",
        "before the next save, one training step later",
        contender="-",
    )
    out.append(
        md_table(
            ["contender", "median", "p90", "max", "% of step", "vs ours", "step-time slowdown (mean)", "notes"], rows
        )
    )
    out += [
        "",
        f"Step time without checkpointing (median): {fmt_ms(step)}. Ours blocks {_x(rt['ours_over_floor_copy'])} "
        f"as long as the bare copy; without overlap {_x(rt['ours_no_overlap_over_ours'])} as long as with it. At "
        f"{fmt_ms(ours)} of blocking a step must last {fmt_ms(rt['step_time_for_1pct_blocking_s'])} or longer for "
        "the blocking to stay under 1%. The slowdown column is the mean iteration time (compute + blocking + wait) "
        "against the steps without checkpointing, in the same rotation: it also holds what the background copy and "
        "persist take from the training thread's compute on this 2-core machine.",
    ]

    pl = r["lightning"]
    runs = pl["runs"]
    lcite = cite
    out += ["", f"{sub} Through Lightning: extra step time per checkpointed step", "", lcite, ""]
    lrows = [["no checkpointing", fmt_ms(_med(runs["none"]["step_interval"])), "—", "—", "baseline"]]
    for key, name, note in (
        ("tiered", "**ours**: `TieredCheckpoint` (RAM every step, disk every K)", "whole Trainer state"),
        ("modelcheckpoint", "`ModelCheckpoint(every_n_train_steps=1)`", "torch.save, synchronous"),
        ("modelcheckpoint_async", "`ModelCheckpoint` + `AsyncCheckpointIO`", "clone on the trainer, save in a thread"),
    ):
        extra = pl["extra_step_s"][key]
        if key == "modelcheckpoint_async":
            drains = ", ".join(f"{x:.1f}" for x in runs[key]["after_last_step_s"])
            note += f"; after the last step fit() took {drains} s more (queued saves)"
        lrows.append(
            [
                name,
                fmt_ms(_med(runs[key]["step_interval"])),
                fmt_ms(extra),
                fmt_pct(ratio(extra, pl["baseline_step_s"])),
                note,
            ]
        )
    out.append(md_table(["run", "step time (median)", "extra vs none", "extra %", "notes"], lrows))
    out += [
        "",
        f"{cfg['lightning_passes']} Trainer run(s) per row of {cfg['lightning_steps_per_pass']} measured steps (after "
        f"{cfg['warmup']} warm-up), alternating order; step time = interval between consecutive "
        "`on_train_batch_start` hooks, so it includes every callback. `TieredCheckpoint` runs with its defaults "
        "(overlapped copy, optimizer guarded). Time inside `on_step` measured by our engine (median; the optimizer's "
        f"wait for the copy is not in it, but is in the step time): {fmt_ms(_med(runs['tiered']['tiered_capture']))} "
        f"({fmt_pct(rt['lightning_tiered_capture_fraction_of_step'])} of a step). ModelCheckpoint's extra time / ours: "
        f"{_x(rt['lightning_modelcheckpoint_over_tiered'])} (sync), "
        f"{_x(rt['lightning_modelcheckpoint_async_over_tiered'])} (async). The rest of ours' extra time is the "
        "optimizer's wait for the copy and the background copy and disk persist competing with the trainer for the "
        "cores (see the persist table). Extra times are "
        "differences of medians from separate runs: expect tens of ms of noise on a shared machine.",
    ]

    p = r["persist"]
    c = p["cadence"]
    default_note = " (the LocalTier default)" if c["persist_every"] == LOCAL_TIER_DEFAULT_EVERY else ""
    out += ["", f"{sub} Step time while the background persist runs", "", cite, ""]
    out.append(
        md_table(
            ["figure", "no checkpointing", "with our engine", "slowdown", "steps"],
            [
                [
                    f"**disk every {c['persist_every']} steps**{default_note}: mean step time, amortized",
                    fmt_ms(c["baseline_iteration"]["mean_s"]),
                    fmt_ms(c["iteration"]["mean_s"]),
                    fmt_pct(c["slowdown_mean"]),
                    f"{c['iteration']['n']} vs {c['baseline_iteration']['n']}",
                ],
                [
                    "… median step time",
                    fmt_ms(_med(c["baseline_iteration"])),
                    fmt_ms(_med(c["iteration"])),
                    fmt_pct(c["slowdown_median"]),
                    "",
                ],
                [
                    "… mean of the steps with a persist in flight",
                    fmt_ms(c["baseline_iteration"]["mean_s"]),
                    fmt_ms(c["iteration_persist_in_flight"]["mean_s"]),
                    fmt_pct(c["slowdown_in_flight_mean"]),
                    str(c["iteration_persist_in_flight"]["n"]),
                ],
                [
                    "… mean of the steps with no persist in flight",
                    fmt_ms(c["baseline_iteration"]["mean_s"]),
                    fmt_ms(c["iteration_no_persist_in_flight"]["mean_s"]),
                    fmt_pct(c["slowdown_no_persist_mean"]),
                    str(c["iteration_no_persist_in_flight"]["n"]),
                ],
                [
                    "**disk every step** (worst case): mean iteration time (compute + blocking)",
                    fmt_ms(p["baseline_iteration"]["mean_s"]),
                    fmt_ms(p["persist_iteration"]["mean_s"]),
                    fmt_pct(p["slowdown_mean"]),
                    f"{p['persist_iteration']['n']} vs {p['baseline_iteration']['n']}",
                ],
                [
                    "… median iteration time",
                    fmt_ms(_med(p["baseline_iteration"])),
                    fmt_ms(_med(p["persist_iteration"])),
                    fmt_pct(p["slowdown_median"]),
                    "",
                ],
                [
                    "… compute only (forward, backward, optimizer), mean",
                    fmt_ms(p["baseline_compute"]["mean_s"]),
                    fmt_ms(p["persist_compute"]["mean_s"]),
                    fmt_pct(p["compute_slowdown_mean"]),
                    "",
                ],
            ],
        )
    )
    out += [
        "",
        f"Disk every {c['persist_every']} steps: {c['rounds'] * 2} windows of {c['window_steps']} steps, ours and "
        "none alternating (A B B A ...); each of our windows starts on a persist step and holds "
        f"{c['persists_per_window']} complete persist{'s' if c['persists_per_window'] != 1 else ''}, so the "
        f"amortized mean over our {c['iteration']['n']} steps "
        f"covers {c['local_writes']} persists (mean {fmt_ms(c['local_write_mean_s'])} each; {c['local_deferred']} "
        "deferred); RAM snapshot every step, overlapped copy. A step has a persist in flight when one started earlier "
        "had not finished as the step began. Noise: the slowdown of each (none, ours) window pair ranges "
        f"{_pct_range(c['slowdown_per_window_pair'])} (median {fmt_pct(c['slowdown_per_window_pair_median'])}). "
        f"Blocking there (median, on_step + optimizer wait): {fmt_ms(_med(c['blocking']))}; "
        f"{fmt_ms(_med(c['blocking_persist_in_flight']))} on steps with a persist in flight, "
        f"{fmt_ms(_med(c['blocking_no_persist_in_flight']))} on the others.{_load_note(r, 'cadence')} The slowdown "
        "depends on how busy the shared machine's cores are: the background copy and persist need a core the "
        "trainer is not using.",
        "",
        f"Disk every step: from the rotation above. Persists started during the measured blocks: {p['local_writes']} "
        f"(mean {fmt_ms(p['local_write_mean_s'])} each, fsynced and checksummed); persists deferred because the "
        f"previous one was still running: {p['local_deferred']}; the background writer was busy "
        f"{fmt_pct(p['persist_duty_cycle'])} of the time.",
    ]

    rs = r["restore"]
    out += ["", f"{sub} Restore (`CheckpointManager.restore`), and applying it", "", cite, ""]
    ram, ram_total = _med(rs["ram"]), _med(rs["ram_total"])
    rrows = [
        [
            "**RAM tier** (the manager holding it; buffers handed over)",
            fmt_ms(ram),
            fmt_ms(_med(rs["ram_apply"])),
            fmt_ms(ram_total),
            "1.0x",
            "1.0x",
        ]
    ]
    for key, name in (
        ("disk_warm", "local disk tier, page cache warm (fresh manager)"),
        ("disk_cold", "local disk tier, cached pages evicted (fresh manager)"),
    ):
        rrows.append(
            [
                name,
                fmt_ms(_med(rs[key])),
                fmt_ms(_med(rs[f"{key}_apply"])),
                fmt_ms(_med(rs[f"{key}_total"])),
                _x(ratio(_med(rs[key]), ram)),
                _x(ratio(_med(rs[f"{key}_total"]), ram_total)),
            ]
        )
    rrows.append(
        [
            "context: `torch.load` of a torch.save file, warm / evicted",
            f"{fmt_ms(_med(rs['torch_load_warm']))} / {fmt_ms(_med(rs['torch_load_cold']))}",
            "",
            "",
            "",
            "",
        ]
    )
    out.append(
        md_table(
            ["source", "`restore()`", "+ `load_state_dict`", "restore + apply", "vs RAM (restore)", "vs RAM (+ apply)"],
            rrows,
        )
    )
    out += [
        "",
        f"Medians of {cfg['restore_reps']} repetitions, interleaved. A RAM restore hands the snapshot's buffers over "
        "(`MemoryTier.take`): the step leaves the RAM tier, so before each repetition the manager takes one fresh, "
        "untimed snapshot. Apply = `model.load_state_dict(state['model'])` + `opt.load_state_dict(state['optim'])` "
        "on the live training objects: what a user pays. Disk restores verify every file's checksum. Eviction uses "
        "`posix_fadvise(DONTNEED)`; a hypervisor cache may still serve those reads.",
    ]

    out += ["", f"{sub} Targets", "", cite, ""]
    trows = []
    for t in r["targets"]:
        value = t["value"]
        shown = "n/a" if value is None else (fmt_pct(value) if t["unit"] == "fraction" else _x(value))
        thr = fmt_pct(t["threshold"]) if t["unit"] == "fraction" else _x(t["threshold"])
        trows.append([t["name"], shown, f"{t['op']} {thr}", f"**{t['verdict']}**", t["note"]])
    out.append(md_table(["target", "measured", "goal", "verdict", "how"], trows))
    out += ["", f"{sub} Reading the figures", ""]
    out += _reading(r)
    return "\n".join(out) + "\n"


def _reading(r: dict[str, Any]) -> list[str]:
    """Plain-language notes computed from the figures (no verdicts that the numbers do not carry)."""
    b, rt, p, rs, cfg = r["blocking"], r["ratios"], r["persist"], r["restore"], r["config"]
    c = p["cadence"]
    floor = _med(b["floor_copy"])
    return [
        f"- **Overlapped copy.** With the copy of parameters and optimizer state moved beside the next "
        f"forward/backward, the training thread is stopped {fmt_ms(_med(b['ours']))} per snapshot (median: "
        f"{fmt_ms(_med(b['ours_on_step']))} inside `on_step`, {fmt_ms(_med(b['ours_hook_wait']))} waiting before "
        f"the optimizer step; p90 of that wait {fmt_ms(b['ours_hook_wait']['p90_s'])}), against "
        f"{fmt_ms(_med(b['ours_no_overlap']))} when `on_step` copies everything and {fmt_ms(floor)} for a bare "
        "`copy_` of the same bytes. The copy still costs the same CPU work: it runs on the other core, and on "
        "this 2-core machine it competes with the trainer (see the slowdown column).",
        f"- **Against the baselines.** `torch.save` blocks {_x(rt['torch_save_over_ours'])} and `dcp.async_save` "
        f"{_x(rt['dcp_async_save_over_ours'])} as long as ours (without overlap: "
        f"{_x(rt['torch_save_over_ours_no_overlap'])} and {_x(rt['dcp_async_save_over_ours_no_overlap'])}). "
        "`dcp.async_save` stages its copy on the training thread, so it is bounded by the bare copy; ours is not.",
        f"- **Blocking share.** {fmt_pct(rt['ours_blocking_fraction_of_step'])} of a "
        f"{fmt_ms(r['step_time']['baseline_median_s'])} step with overlap, "
        f"{fmt_pct(rt['ours_no_overlap_blocking_fraction_of_step'])} without; at "
        f"{cfg['state_bytes_engine'] / 1e6:.0f} MB per snapshot.",
        f"- **Background persist.** Each persist writes the snapshot with fsync and checksums "
        f"({fmt_ms(c['local_write_mean_s'])} at the realistic cadence). At disk every {c['persist_every']} steps the "
        f"mean step time rises {fmt_pct(c['slowdown_mean'])} (amortized): steps with a persist in flight are "
        f"{fmt_pct(c['slowdown_in_flight_mean'])} slower than steps without checkpointing, the others "
        f"{fmt_pct(c['slowdown_no_persist_mean'])} (the per-step RAM snapshot: its blocking and its background copy "
        f"competing for the cores). Persisting every step keeps the writer busy "
        f"{fmt_pct(p['persist_duty_cycle'])} of the time and slows the mean step by {fmt_pct(p['slowdown_mean'])}: "
        f"on {r['machine']['cpu_count']} shared cores the writer takes CPU and memory bandwidth from the trainer.",
        f"- **Restore.** A RAM-tier restore hands the snapshot's buffers over without copying: "
        f"{fmt_ms(_med(rs['ram']))}, {_x(rt['restore_disk_warm_over_ram'])} faster than a disk restore with a warm "
        f"page cache ({fmt_ms(_med(rs['disk_warm']))}; {fmt_ms(_med(rs['disk_cold']))} evicted), which reads, "
        f"verifies checksums and loads. Applying the state to the live model and optimizer adds "
        f"{fmt_ms(_med(rs['ram_apply']))} after a RAM restore and {fmt_ms(_med(rs['disk_warm_apply']))} after a "
        f"disk restore, so restore + apply is {_x(rt['restore_applied_disk_warm_over_ram'])} faster from RAM (warm "
        f"disk) and {_x(rt['restore_applied_disk_cold_over_ram'])} (evicted).",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    result = run(args, argv)
    path = write_json(args.out, result)
    print_flush("")
    print_flush(render_markdown(result))
    print_flush(f"[checkpoint] total {result['total_wall_s']:.0f}s; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
