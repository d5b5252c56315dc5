"""CheckpointManager: snapshots every step, persists to slower tiers in the background, restores collectively.

Framework-free: the caller hands it a step number and a function that returns the state to capture. Decisions
that change what is on disk or which step is restored are made by all ranks together over a side gloo group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.errors import CheckpointCorruptError, CheckpointWorkerError, NoValidCheckpointError
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.reshard import reshardable_steps, restore_resharded_agreed
from lightning_resilience.checkpoint.snapshot import HostSnapshot, SnapshotPool
from lightning_resilience.checkpoint.tier import Tier, TierIdentity
from lightning_resilience.checkpoint.tree import DTensorRebuilder, flatten_state, unflatten_state
from lightning_resilience.checkpoint.worker import PersistWorker

__all__ = ["CheckpointManager", "CheckpointStats", "Restored", "TierStats"]

log = logging.getLogger(__name__)


@dataclass
class TierStats:
    """Counters of one tier, for metrics and the end-of-run report."""

    writes: int = 0
    failures: int = 0
    deferred: int = 0
    bytes: int = 0
    seconds: float = 0.0
    last_step: int | None = None
    last_error: str | None = None


@dataclass
class CheckpointStats:
    """What the engine did and what it cost."""

    captures: int = 0
    capture_seconds: float = 0.0
    capture_seconds_max: float = 0.0
    last_capture_seconds: float = 0.0
    wait_seconds: float = 0.0
    """Part of ``capture_seconds`` spent waiting for a background copy before an optimizer step."""
    state_bytes: int = 0
    host_bytes: int = 0
    tiers: dict[str, TierStats] = field(default_factory=dict)
    restored_step: int | None = None
    restored_from: str | None = None
    restore_seconds: float = 0.0
    skipped_corrupt: list[str] = field(default_factory=list)

    @property
    def capture_seconds_mean(self) -> float:
        return self.capture_seconds / self.captures if self.captures else 0.0


@dataclass
class Restored:
    """The outcome of a collective restore."""

    step: int
    state: Any
    tier: str
    seconds: float
    meta: dict[str, Any]


@dataclass
class _PersistResult:
    tier: str
    step: int
    nbytes: int
    seconds: float
    error: BaseException | None = None


class CheckpointManager:
    """Drives a set of tiers for one rank.

    Args:
        tiers: e.g. ``[MemoryTier(every_n_steps=1, keep=2), LocalTier("/nvme/ckpt", every_n_steps=20)]``.
        config: engine behaviour; defaults are sensible for training jobs.
        clock: monotonic seconds, injectable for tests.
    """

    Config = CheckpointConfig

    def __init__(
        self,
        tiers: Sequence[Tier],
        config: CheckpointConfig | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not tiers:
            raise ValueError("checkpoint.tiers must name at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"checkpoint.tiers must have unique names, got {names}")
        self.tiers = sorted(tiers, key=lambda t: t.durability)
        self.config = config or CheckpointConfig()
        self._clock = clock
        self._memory = [t for t in self.tiers if isinstance(t, MemoryTier)]
        self._persistent = [t for t in self.tiers if not isinstance(t, MemoryTier)]
        memory_keep = sum(t.keep for t in self._memory)
        self._pool = SnapshotPool(max_slots=self.config.max_host_copies or memory_keep + 2)
        self._worker = PersistWorker()
        self._deferred: list[Tier] = []
        self._group: Any = None
        self.identity = TierIdentity()
        self.stats = CheckpointStats(tiers={t.name: TierStats() for t in self.tiers})
        self._meta_providers: list[Callable[[int], dict[str, Any]]] = []
        self._warned: set[str] = set()
        self._closed = False

    # ------------------------------------------------------------------ setup
    def setup(self, group: Any = None) -> None:
        """Bind tiers to this rank. Collective when ``torch.distributed`` is initialised (all ranks call it)."""
        if dist.is_available() and dist.is_initialized():
            self.identity = TierIdentity(dist.get_rank(group), dist.get_world_size(group))
            if self.identity.world_size > 1:
                # a side group: our small agreements never interleave with the training collectives
                self._group = dist.new_group(
                    ranks=dist.get_process_group_ranks(group) if group else None, backend="gloo"
                )
        for tier in self.tiers:
            tier.bind(self.identity)

    @property
    def world_size(self) -> int:
        return self.identity.world_size

    def add_meta_provider(self, provider: Callable[[int], dict[str, Any]]) -> None:
        """Merge ``provider(step)`` into the metadata of every snapshot (it lands in each tier's manifest).

        Other components record what they know about a step this way, e.g. whether it was verified clean.
        """
        self._meta_providers.append(provider)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:  # the same state shape is captured every step: say it once
            self._warned.add(message)
            log.warning(message)

    def _meta(self, step: int, meta: dict[str, Any] | None) -> dict[str, Any]:
        out = dict(meta or {})
        for provider in self._meta_providers:
            out.update(provider(step))
        return out

    def steps(self) -> dict[str, list[int]]:
        """Committed steps of this rank, per tier (local view; restores agree across ranks)."""
        return {t.name: t.list_steps() for t in self.tiers}

    # ------------------------------------------------------------- per step
    def on_step(
        self,
        step: int,
        state: Callable[[], Any],
        meta: dict[str, Any] | None = None,
        *,
        overlap: Callable[[torch.Tensor], bool] | None = None,
    ) -> bool:
        """Snapshot ``state()`` if any tier wants ``step``; start a background persist if one is due.

        Only the host copy (and, at a persist cadence, one small agreement) blocks the caller. Tensors for which
        ``overlap`` is true are copied in the background instead: they must stay unchanged until
        :meth:`wait_snapshot` returns (see :meth:`guard_optimizer`, which calls it before every optimizer step).
        Returns True when a snapshot was taken.
        """
        self.collect()
        memory_due = [t for t in self._memory if step % t.every_n_steps == 0]
        persist_due = list(
            dict.fromkeys([*self._deferred, *(t for t in self._persistent if step % t.every_n_steps == 0)])
        )
        if not memory_due and not persist_due:
            return False
        start = self._clock()
        persist_now: list[Tier] = []
        protect: dict[str, int | None] = {}
        if persist_due:
            busy, protect = self._agree(persist_due)
            if busy:  # every rank defers together, so every rank persists the same steps
                for tier in persist_due:
                    self.stats.tiers[tier.name].deferred += 1
                self._deferred = persist_due
            else:
                persist_now, self._deferred = persist_due, []
        if memory_due or persist_now:
            flat = flatten_state(state(), warn=self._warn_once)
            slot = self._pool.capture(
                step, flat, self._meta(step, meta), timeout=self.config.snapshot_timeout, overlap=overlap
            )
            for tier in memory_due:
                self._pool.retain(slot)
                tier.adopt(slot, self._pool.release)
                self._record_write(tier.name, step, slot.nbytes, 0.0)
            if persist_now:
                self._pool.retain(slot)
                self._worker.submit(partial(self._persist, slot, persist_now, protect))
            self._pool.release(slot)
            self.stats.state_bytes = slot.nbytes
            self.stats.host_bytes = self._pool.host_bytes
            self.stats.captures += 1
        elapsed = self._clock() - start  # an agreement that only deferred a persist blocked too
        self.stats.capture_seconds += elapsed
        self.stats.last_capture_seconds = elapsed
        self.stats.capture_seconds_max = max(self.stats.capture_seconds_max, elapsed)
        return bool(memory_due or persist_now)

    def flush(self, step: int, state: Callable[[], Any], meta: dict[str, Any] | None = None) -> None:
        """Persist ``step`` to every persistent tier now and wait for it (end of training, before a planned stop).

        Collective like :meth:`on_step`: every rank calls it with the same step.
        """
        if not self._persistent:
            return
        self.wait()
        self._deferred = []
        _, protect = self._agree(self._persistent)  # collective: before any rank-local early return
        missing = [t for t in self._persistent if step not in t.list_steps()]
        if not missing:
            return
        slot = self._pool.capture(step, flatten_state(state(), warn=self._warn_once), self._meta(step, meta))
        self._worker.submit(partial(self._persist, slot, missing, protect))  # takes over our slot reference
        if not self.wait():
            log.error("final persist of step %d did not finish within %s", step, self.config.drain_timeout)

    def emergency_save(self, deadline: timedelta | None = None, *, collective: bool = False) -> int | None:
        """Persist the newest RAM snapshot to the persistent tiers, fastest first, until ``deadline`` runs out.

        For a preemption notice or an exception: the snapshot is the last state captured at a step boundary, not
        the live (possibly half-updated) state. With ``collective=True`` every rank calls it (retention then keeps
        the newest step committed everywhere); otherwise it is rank-local and deletes nothing.

        Returns:
            The step persisted to at least one tier (or already there), or None if there was nothing to save.
        """
        budget = deadline or self.config.drain_timeout
        start = time.perf_counter()

        def remaining() -> float:
            return budget.total_seconds() - (time.perf_counter() - start)

        self.wait_snapshot()
        if not self._worker.wait_idle(timedelta(seconds=max(remaining(), 0.0))):
            log.error("emergency save: the running persist did not finish in time; nothing more written")
            return None
        self.collect()
        protect: dict[str, int | None] = {}
        if collective:
            _, protect = self._agree(self._persistent)
        held = [(s, t) for t in self._memory for s in t.list_steps()]
        if not held:
            log.warning("emergency save: no snapshot in RAM to save")
            return None
        step, tier = max(held, key=lambda x: x[0])
        saved = False
        snap = None
        for target in self._persistent:
            if step in target.list_steps():
                saved = True
                continue
            if remaining() <= 0:
                log.error("emergency save: deadline reached before tier %r got step %d", target.name, step)
                break
            t0 = time.perf_counter()
            try:
                snap = snap or tier.read(step)
                target.write(snap)
                if collective:
                    self._apply_retention(target, protect.get(target.name))
            except (OSError, CheckpointCorruptError) as err:
                self.stats.tiers[target.name].failures += 1
                self.stats.tiers[target.name].last_error = f"{type(err).__name__}: {err}"
                log.error("emergency save of step %d to tier %r failed: %s", step, target.name, err)
                continue
            written = getattr(target, "last_write_bytes", 0) or snap.nbytes
            self._record_write(target.name, step, written, time.perf_counter() - t0)
            saved = True
            log.warning("emergency save: step %d committed to tier %r", step, target.name)
        return step if saved else None

    def wait_snapshot(self) -> None:
        """Block (bounded) until the newest snapshot's background copy has landed; the wait counts as blocking."""
        start = self._clock()
        self._pool.wait_inflight(self.config.snapshot_timeout)
        self._bill_wait(start)

    def order_snapshot(self) -> None:
        """Before the optimizer changes what the newest snapshot copies: on a GPU the training stream waits for the
        copy (the CPU does not, and the forward and backward before it overlapped the copy); on the CPU the training
        thread waits for the background copy. The wait counts as blocking."""
        start = self._clock()
        self._pool.order_inflight(self.config.snapshot_timeout)
        self._bill_wait(start)

    def _bill_wait(self, start: float) -> None:
        waited = self._clock() - start
        self.stats.capture_seconds += waited
        self.stats.wait_seconds += waited

    def guard_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step`` come after an in-flight snapshot copy of the tensors it is about to change.

        Returns the hook handle (``.remove()`` it when done).
        """
        return optimizer.register_step_pre_hook(lambda *_: self.order_snapshot())

    def _agree(self, tiers: list[Tier]) -> tuple[bool, dict[str, int | None]]:
        """Collectively: is any rank's worker busy, and which step is committed on every rank, per tier."""
        local = (self._worker.busy, {t.name: t.list_steps() for t in tiers})
        gathered = self._all_gather(local)
        busy = any(g[0] for g in gathered)
        protect: dict[str, int | None] = {}
        for tier in tiers:
            common = set.intersection(*(set(g[1][tier.name]) for g in gathered))
            protect[tier.name] = max(common) if common else None
        return busy, protect

    def _persist(self, slot: HostSnapshot, tiers: list[Tier], protect: dict[str, int | None]) -> list[_PersistResult]:
        """Runs on the worker thread: write the slot to each tier, then apply retention."""
        results = []
        try:
            snap = slot.view()
            for tier in tiers:
                start = time.perf_counter()
                try:
                    tier.write(snap)
                    self._apply_retention(tier, protect.get(tier.name))
                except OSError as err:
                    results.append(_PersistResult(tier.name, snap.step, 0, time.perf_counter() - start, err))
                    continue
                written = getattr(tier, "last_write_bytes", 0) or snap.nbytes  # a delta tier writes less
                results.append(_PersistResult(tier.name, snap.step, written, time.perf_counter() - start))
        finally:
            self._pool.release(slot)
        return results

    @staticmethod
    def _apply_retention(tier: Tier, protected: int | None) -> None:
        steps = tier.list_steps()
        keep = set(steps[-tier.keep :])
        if protected is not None:
            keep.add(protected)  # the newest step every rank has committed is never deleted
        for step in steps:
            if step not in keep:
                tier.delete(step)

    def collect(self) -> None:
        """Fold finished persists into the stats; re-raise a worker failure on the calling (training) thread."""
        for results in self._worker.poll():
            for res in results:
                if res.error is None:
                    self._record_write(res.tier, res.step, res.nbytes, res.seconds)
                    continue
                stats = self.stats.tiers[res.tier]
                stats.failures += 1
                stats.last_error = f"{type(res.error).__name__}: {res.error}"
                log.warning(
                    "checkpoint of step %d to tier %r failed (%s); training continues, earlier checkpoints are intact",
                    res.step,
                    res.tier,
                    stats.last_error,
                )
                if self.config.on_persist_error == "raise":
                    raise CheckpointWorkerError(
                        f"persist of step {res.step} to tier {res.tier!r} failed: {stats.last_error} "
                        "(checkpoint.on_persist_error=raise)"
                    ) from res.error

    def _record_write(self, tier: str, step: int, nbytes: int, seconds: float) -> None:
        stats = self.stats.tiers[tier]
        stats.writes += 1
        stats.bytes += nbytes
        stats.seconds += seconds
        stats.last_step = step

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait (bounded) for the in-flight persist; True if the worker is idle."""
        idle = self._worker.wait_idle(timeout or self.config.drain_timeout)
        self.collect()
        return idle

    # ---------------------------------------------------------------- restore
    def restore(
        self,
        step: int | None = None,
        *,
        max_step: int | None = None,
        rebuild_dtensor: DTensorRebuilder | None = None,
    ) -> Restored | None:
        """Collectively pick and load the newest step that every rank can load (or exactly ``step``).

        Each rank lists committed steps in all its tiers; the candidates are the steps every rank has. From the
        newest down, every rank loads and validates its shard from its fastest tier that has one; the step is
        taken only if all ranks succeeded. A corrupt or partial shard is skipped with a warning naming it.
        ``max_step`` bounds the choice (a rollback to a step known to be good). ``rebuild_dtensor`` turns saved
        local shards back into DTensors (sharded strategies only).

        Raises:
            NoValidCheckpointError: ``step`` was requested but is not loadable everywhere, or nothing valid was
                found and ``checkpoint.if_none_valid`` is ``fail``.
        """
        self.wait_snapshot()
        # a persist in flight may still read snapshot buffers that a RAM restore hands to the training state
        if not self._worker.wait_idle(self.config.drain_timeout):
            raise CheckpointWorkerError(f"persist still running after {self.config.drain_timeout}; cannot restore")
        self.collect()
        start = self._clock()
        for tier in self.tiers:
            prepare = getattr(tier, "prepare_restore", None)  # collective: e.g. fetch shards held by peers
            if prepare is not None:
                try:
                    prepare()
                except (OSError, RuntimeError, CheckpointCorruptError) as err:
                    msg = f"tier {tier.name!r} could not prepare its copies for restore: {err}"
                    log.warning(msg)
                    self.stats.skipped_corrupt.append(msg)
        where: dict[int, list[Tier]] = {}
        for tier in self.tiers:
            for s in tier.list_steps():
                where.setdefault(s, []).append(tier)
        gathered = self._all_gather(sorted(where))
        common = set.intersection(*(set(g) for g in gathered))
        anything = any(gathered)
        if step is not None:
            common &= {step}
        if max_step is not None:
            common = {s for s in common if s <= max_step}
        if step is None and common and self.config.allow_reshard:
            # a newer step written by another world size (the job shrank or grew since) beats an older native one
            resharded = self._restore_resharded(max_step, rebuild_dtensor, start, newer_than=max(common))
            if resharded is not None:
                return resharded
        for candidate in sorted(common, reverse=True):
            snap, source = None, ""
            for tier in where[candidate]:
                try:
                    # RAM hands its buffers over instead of copying them
                    snap = tier.take(candidate) if isinstance(tier, MemoryTier) else tier.read(candidate)
                    source = tier.name
                    break
                except (CheckpointCorruptError, OSError) as err:  # every rank must reach the agreement below
                    msg = f"skipping checkpoint step {candidate} in tier {tier.name!r}: {err}"
                    log.warning(msg)
                    self.stats.skipped_corrupt.append(msg)
            if self._all_true(snap is not None):
                assert snap is not None
                state = unflatten_state(snap.skeleton, snap.tensors, rebuild_dtensor=rebuild_dtensor)
                elapsed = self._clock() - start
                self.stats.restored_step, self.stats.restored_from, self.stats.restore_seconds = (
                    candidate,
                    source,
                    elapsed,
                )
                log.info("restored step %d from tier %r in %.3fs", candidate, source, elapsed)
                return Restored(candidate, state, source, elapsed, snap.meta)
            if snap is not None:
                log.warning("step %d is valid here but not on every rank; trying an older one", candidate)
        if step is None and self.config.allow_reshard:  # nothing at this world size: a step written by another?
            resharded = self._restore_resharded(max_step, rebuild_dtensor, start)
            if resharded is not None:
                return resharded
        if step is not None:
            raise NoValidCheckpointError(
                f"checkpoint step {step} is not loadable on every rank (see warnings above); "
                "pick another step or set checkpoint.resume=auto"
            )
        if anything:
            if self.config.if_none_valid == "fail":
                raise NoValidCheckpointError(
                    "checkpoints exist but none is valid on every rank (see warnings above); "
                    "fix or remove them, or set checkpoint.if_none_valid=start_fresh"
                )
            log.warning(
                "checkpoints exist but none is valid on every rank: starting fresh "
                "(checkpoint.if_none_valid=start_fresh)"
            )
        return None

    def _restore_resharded(
        self,
        max_step: int | None,
        rebuild_dtensor: DTensorRebuilder | None,
        start: float,
        newer_than: int | None = None,
    ) -> Restored | None:
        """Collective: restore the newest step that a job of another world size wrote, resharded for this one
        (only if it is newer than ``newer_than``, the best step loadable as it is)."""
        roots = {t.name: root for t in self._persistent if isinstance(root := getattr(t, "root", None), Path)}
        if newer_than is not None:
            newer = any(
                s > newer_than and (max_step is None or s <= max_step)
                for root in roots.values()
                for s in reshardable_steps(root, self.world_size)
            )
            if self._all_true(not newer):  # collective: every rank takes the same path
                return None
        if not roots:
            return None

        def skip(msg: str) -> None:
            log.warning(msg)
            self.stats.skipped_corrupt.append(msg)

        found = restore_resharded_agreed(
            roots,
            self.identity,
            all_gather=self._all_gather,
            all_true=self._all_true,
            rebuild_dtensor=rebuild_dtensor,
            max_step=max_step,
            on_skip=skip,
        )
        if found is None:
            return None
        name, res = found
        if newer_than is not None and res.step <= newer_than:
            return None  # the same on every rank: the agreed step is older than a native one
        elapsed = self._clock() - start
        self.stats.restored_step, self.stats.restored_from, self.stats.restore_seconds = res.step, name, elapsed
        log.warning(
            "restored step %d from tier %r, resharded from %d to %d ranks (per-rank RNG and data position taken "
            "from old rank new_rank %% %d: not an exact resume)",
            res.step,
            name,
            res.old_world_size,
            self.world_size,
            res.old_world_size,
        )
        return Restored(res.step, res.state, name, elapsed, res.meta)

    def _all_gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _all_true(self, flag: bool) -> bool:
        if self.world_size == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group)
        return bool(t.item())

    # --------------------------------------------------------------- teardown
    def close(self, timeout: timedelta | None = None) -> None:
        """Drain the in-flight persist (bounded) and stop the worker; no save outlives this call."""
        if self._closed:
            return
        self._closed = True
        self._pool.close(self.config.snapshot_timeout)
        drained = self._worker.close(timeout or self.config.drain_timeout)
        if not drained:
            log.error("checkpoint persist did not finish within %s; its step is not committed", timeout)
        self.collect()
