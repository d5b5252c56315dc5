"""The ways of checkpointing that the benchmark compares, on one plain training loop.

A contender checkpoints right after each training step (``after_step``; ``disk=False`` on the steps that continue a
turn while its background work finishes), may wait inside the next step (an optimizer pre-hook, registered by
``begin`` for its turn only), says whether background work is still running (``busy``) and drains it at the end of
its turn (``end_turn``). ``blocking`` accumulates what the training thread spent in the contender (the call after the
step and the waits in the hook); the step-time figures come from the loop's own clock.

* :class:`NoCheckpoint`: the baseline.
* :class:`BareCopy`: the floor of a per-step snapshot: ``copy_`` of every tensor of the state into host buffers
  allocated once (pinned, on a GPU), on the training thread, each step; nothing else.
* :class:`Ours`: ``CheckpointManager`` with the default preset's tiers (``configs/resilience/checkpoint/local.yaml``:
  RAM every step, keep 2; local disk every 10 steps, keep 3), or the RAM tier alone, with the overlapped copy and
  the optimizer guard that ``TieredCheckpoint`` installs.
* :class:`DcpBest`: PyTorch DCP at its best, as torchtitan's ``async_with_pinned_mem``: ``dcp.async_save`` with one
  reused ``DefaultStager(StagingOptions(use_pinned_memory, use_shared_memory, use_async_staging=True,
  use_non_blocking_copy))`` (pinned memory and non-blocking copies need a GPU; on a CPU they are off), the wait on
  ``staging_completion`` in an optimizer pre-hook, the wait on the previous ``upload_completion`` before the next
  save; thread or process executor. At our cadence (every step into RAM, a tmpfs directory, and every 10 steps to
  the local disk instead), or at its own best one: the local disk every 10 steps, nothing in between.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._workload import GPTWorkload

__all__ = ["BareCopy", "Contender", "DcpBest", "NoCheckpoint", "Ours", "optimizer_owned", "ram_dir"]

DISK_EVERY = 10
"""The local tier's cadence in the default preset (``local.yaml``)."""

pc = time.perf_counter


def ram_dir(prefix: str, need_bytes: int = 0) -> tuple[Path, bool]:
    """A fresh directory in RAM (``/dev/shm``) when there is one with ``need_bytes`` free, else in the temporary
    directory; and whether it is in RAM."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= need_bytes:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=shm)), True
    return Path(tempfile.mkdtemp(prefix=prefix)), False


def optimizer_owned(wl: GPTWorkload) -> Callable[[torch.Tensor], bool]:
    """Storages of the parameters and the optimizer state: they change only inside ``optimizer.step`` (the predicate
    ``TieredCheckpoint`` builds, see ``_changed_only_by_optimizer``)."""
    from lightning_resilience.checkpoint.tree import storage_ptr

    storages = {storage_ptr(p) for p in wl.model.parameters()}
    for state in wl.opt.state.values():
        storages.update(storage_ptr(v) for v in state.values() if isinstance(v, torch.Tensor))
    storages.discard(0)
    return lambda t: storage_ptr(t) in storages


class Contender:
    name = ""

    def __init__(self) -> None:
        self.blocking = 0.0
        self.snapshot = False
        """Whether the last :meth:`after_step` took a snapshot (read and cleared by :meth:`take_snapshot`)."""
        self._hooks: list[Any] = []

    def begin(self) -> None:
        """Its turn starts: install its hooks."""

    def after_step(self, step: int, disk: bool = True) -> None:
        """Checkpoint ``step`` (runs right after the optimizer step); ``disk=False``: no new disk save."""

    def busy(self) -> bool:
        """Background work of an earlier step is still running."""
        return False

    def end_turn(self) -> None:
        """Its turn ends: wait for its background work (billed to the turn), then remove its hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def take_blocking(self) -> float:
        blocked, self.blocking = self.blocking, 0.0
        return blocked

    def take_snapshot(self) -> bool:
        took, self.snapshot = self.snapshot, False
        return took

    def close(self) -> dict[str, Any]:
        return {}


class NoCheckpoint(Contender):
    name = "none"


class BareCopy(Contender):
    """The floor: every tensor of the state copied into host buffers allocated once, each step, nothing else."""

    name = "floor"

    def __init__(self, wl: GPTWorkload) -> None:
        from lightning_resilience.checkpoint.tree import flatten_state

        super().__init__()
        self.wl = wl
        self.flatten = flatten_state
        tensors = flatten_state(wl.state()).tensors
        pin = torch.cuda.is_available() and any(t.is_cuda for t in tensors.values())
        self.buffers = {
            n: torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for n, t in tensors.items()
        }
        self.cuda = pin

    def after_step(self, step: int, disk: bool = True) -> None:
        t0 = pc()
        for name, tensor in self.flatten(self.wl.state()).tensors.items():
            self.buffers[name].copy_(tensor.detach(), non_blocking=self.cuda)
        if self.cuda:  # the copy is on the training stream: the next step's kernels queue behind it
            torch.cuda.current_stream().synchronize()
        self.blocking += pc() - t0

    def close(self) -> dict[str, Any]:
        return {"host_bytes": sum(b.numel() * b.element_size() for b in self.buffers.values()), "pinned": self.cuda}


class Ours(Contender):
    """``CheckpointManager([MemoryTier(1, keep=2), LocalTier(root, DISK_EVERY, keep=3)])`` with the overlapped copy
    (``disk_every=None``: the RAM tier alone; either cadence 0: the cost budget decides, ``config.overhead_budget``)."""

    def __init__(
        self,
        wl: GPTWorkload,
        root: Path,
        *,
        disk_every: int | None = DISK_EVERY,
        ram_every: int = 1,
        name: str = "ours",
        config: Any = None,
    ) -> None:
        from lightning_resilience.checkpoint import CheckpointManager, LocalTier, MemoryTier

        super().__init__()
        self.name = name
        self.wl = wl
        tiers: list[Any] = [MemoryTier(every_n_steps=ram_every, keep=2)]
        if disk_every is not None:
            tiers.append(LocalTier(root, every_n_steps=disk_every, keep=3))
        self.mgr = CheckpointManager(tiers, config)
        self.mgr.setup()
        self._disk_every = disk_every

    def _billed(self) -> float:
        return self.mgr.stats.capture_seconds  # on_step and the optimizer guard's waits

    def begin(self) -> None:
        self._hooks = [self.mgr.guard_optimizer(self.wl.opt)]
        self._mark = self._billed()

    def after_step(self, step: int, disk: bool = True) -> None:
        # the predicate is rebuilt every step, as TieredCheckpoint does
        self.snapshot = self.mgr.on_step(step, self.wl.state, overlap=optimizer_owned(self.wl))
        now = self._billed()
        self.blocking += now - self._mark
        self._mark = now

    def busy(self) -> bool:
        from datetime import timedelta

        return not self.mgr.wait(timedelta(microseconds=1))  # a zero timeout would mean the default one

    def end_turn(self) -> None:
        self.mgr.wait_snapshot()
        self.mgr.wait()
        self.blocking += self._billed() - self._mark
        super().end_turn()

    def close(self) -> dict[str, Any]:
        s = self.mgr.stats
        local = s.tiers.get("local")
        out = {
            "state_bytes": s.state_bytes,
            "host_bytes": s.host_bytes,
            "pinned": self.mgr._pool.pinned,
            "local_writes": local.writes if local else 0,
            "local_deferred": local.deferred if local else 0,
            "local_write_mean_s": local.seconds / local.writes if local and local.writes else None,
            "cadence": self.mgr.cadence.report() if self.mgr.cadence.budgeted else None,
        }
        self.mgr.close()
        return out


class DcpBest(Contender):
    """``dcp.async_save`` as torchtitan's ``async_with_pinned_mem`` does it (see the module docstring)."""

    def __init__(
        self,
        wl: GPTWorkload,
        ram_root: Path,
        disk_root: Path,
        *,
        process: bool,
        disk_every: int = DISK_EVERY,
        every_step: bool = True,
    ) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        super().__init__()
        cadence = "best" if every_step else "own"
        self.name = f"dcp_{cadence}_{'process' if process else 'thread'}"
        self.every_step = every_step
        self.dcp = dcp
        self.wl = wl
        self.roots = {"ram": ram_root, "disk": disk_root}
        self.disk_every = disk_every
        gpu = torch.cuda.is_available()
        self.options = StagingOptions(
            use_pinned_memory=gpu, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=gpu
        )
        self.stager = DefaultStager(self.options)  # reused: its staging buffers are cached across saves
        self.renewed = 0
        self.kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        self.staging: Any = None
        self.upload: Any = None
        self.saved: dict[str, list[Path]] = {"ram": [], "disk": []}
        self.uploads = 0

    def _wait_staging(self, *_: Any) -> None:
        if self.staging is not None:
            t0 = pc()
            self.staging.result()
            self.staging = None
            self.blocking += pc() - t0

    def begin(self) -> None:
        self._hooks = [self.wl.opt.register_step_pre_hook(self._wait_staging)]

    def busy(self) -> bool:
        return self.upload is not None and not self.upload.done()

    def after_step(self, step: int, disk: bool = True) -> None:
        where = "disk" if disk and step % self.disk_every == 0 else "ram"
        if where == "ram" and not self.every_step:
            return  # its own cadence: the disk only
        t0 = pc()
        if self.upload is not None:  # one save in flight at a time (torchtitan waits the same way)
            self.upload.result()
            self.upload = None
        path = self.roots[where] / f"step_{step:07d}"
        self._renew_closed_stager()
        resp = self.dcp.async_save(
            self.wl.state(), checkpoint_id=path, async_stager=self.stager, async_checkpointer_type=self.kind
        )
        self.staging, self.upload = resp.staging_completion, resp.upload_completion
        self.uploads += 1
        saved = self.saved[where]
        saved.append(path)
        while len(saved) > 2:  # all but the newest are complete: their futures were waited on
            shutil.rmtree(saved.pop(0), ignore_errors=True)
        self.blocking += pc() - t0

    def _renew_closed_stager(self) -> None:
        """Torch 2.11's ``DefaultStager`` closes itself after each stage (its cache and copy table cleared; the next
        stage fails with ``KeyError: <class 'type'>``): there a stager per save is what DCP can do, and is counted."""
        inner = getattr(self.stager, "_state_dict_stager", None)
        if inner is not None and not getattr(inner, "_deepcopy_dispatch", True):
            self.stager = type(self.stager)(self.options)
            self.renewed += 1

    def end_turn(self) -> None:
        t0 = pc()
        self._wait_staging()
        if self.upload is not None:
            self.upload.result()
            self.upload = None
        self.blocking += pc() - t0
        super().end_turn()

    def newest(self, where: str) -> Path | None:
        return self.saved[where][-1] if self.saved[where] else None

    def close(self) -> dict[str, Any]:
        self.stager.close()
        return {
            "executor": self.kind.value,
            "staging_options": {k: getattr(self.options, k) for k in vars(self.options)},
            "saves": self.uploads,
            "stagers_renewed": self.renewed,  # > 0: this torch closes the stager after each stage (no reuse)
        }
