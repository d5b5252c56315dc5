"""CheckpointManager: snapshots every step, persists to slower tiers in the background, restores collectively.

Framework-free: the caller hands it a step number and a function that returns the state to capture. Decisions that
change what is on disk or which step is restored are made by all ranks together (the step's agreement, or the side
group bounded by ``checkpoint.collective_timeout_s``), reached by every rank on every path. This module captures and
persists; restoring is :mod:`.restore`, retention :mod:`.retention`, the save before the process goes
:mod:`.emergency`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, cast

import torch

from lightning_resilience.checkpoint.cadence import CadenceController
from lightning_resilience.checkpoint.certify import check_verified_only, publishable, reject_newer
from lightning_resilience.checkpoint.commits import CommitListeners
from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.content import ContentPrint
from lightning_resilience.checkpoint.emergency import EmergencySave
from lightning_resilience.checkpoint.errors import CheckpointWorkerError
from lightning_resilience.checkpoint.persist_view import PersistAgreement
from lightning_resilience.checkpoint.restore import CollectiveRestore
from lightning_resilience.checkpoint.retention import apply_retention
from lightning_resilience.checkpoint.snapshot import HostSnapshot, SnapshotPool
from lightning_resilience.checkpoint.stats import CheckpointStats, PersistResult, Restored, TierStats
from lightning_resilience.checkpoint.tier import Durability, RamTier, Tier, TierIdentity, restore_order
from lightning_resilience.checkpoint.tree import DTensorRebuilder, flatten_state
from lightning_resilience.checkpoint.worker import PersistWorker, WriterProcess
from lightning_resilience.collective import Deadline, SideGroup

__all__ = ["CheckpointManager", "CheckpointStats", "Restored", "TierStats"]

log = logging.getLogger(__name__)


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
        self.tiers = restore_order(list(tiers))
        self.config = config or CheckpointConfig()
        check_verified_only(self.config.verified_only, names)
        self._clock = clock
        # a RAM tier holds the snapshot buffers themselves (the RamTier protocol), in process or shared memory
        self._memory = [cast(RamTier, t) for t in self.tiers if t.ram]
        self._persistent = [t for t in self.tiers if not t.ram]
        memory_keep = sum(t.keep for t in self._memory)
        slots = self.config.max_host_copies or memory_keep + 2
        self._pool = SnapshotPool(max_slots=slots, buffers=self._memory[0].buffers(slots) if self._memory else None)
        self._worker = PersistWorker()
        self._writer = WriterProcess(self.config.drain_timeout)
        """Writes persists of snapshots in shared memory, off this process's GIL (started by :meth:`setup`)."""
        self._deferred: list[Tier] = []
        self._group = SideGroup("checkpoint", self.config.collective_timeout, local=True)  # peers come with setup
        self.identity = TierIdentity()
        self.stats = CheckpointStats(tiers={t.name: TierStats() for t in self.tiers})
        mean_write = lambda name: self.stats.tiers[name].mean_write_seconds  # noqa: E731
        # when each tier is due: as set, or chosen by the cost budget (``every_n_steps=0``)
        self.cadence = CadenceController.of(self.tiers, self.config, write_seconds=mean_write, clock=clock)
        self._meta_providers: list[Callable[[int], dict[str, Any]]] = []
        self._commits = CommitListeners()
        self._warned: set[str] = set()
        self._closed = False
        self._failure: BaseException | None = None
        """A persist failure held for the next agreement, so that every rank stops at the same call."""
        # the persist view's part of each step's agreement (register it with a step driver)
        local = lambda: (not self._worker.busy, self._failure is None)  # noqa: E731
        self.agreement = PersistAgreement([t.name for t in self._persistent], local, self._raise_failure, self._group)

    # ------------------------------------------------------------------ setup
    def setup(self, group: Any = None, *, side: SideGroup | None = None) -> None:
        """Bind tiers to this rank. Collective when ``torch.distributed`` is initialised (all ranks call it).

        Args:
            group: the ranks to span (a process group; default all).
            side: the side group to agree on (a view of a group shared with other components); default one of the
                manager's own over ``group``.
        """
        # a side group: our small agreements never interleave with the training collectives
        self._group = side or SideGroup("checkpoint", self.config.collective_timeout, parent=group)
        self.identity = TierIdentity(self._group.rank, self._group.world_size)
        self.agreement.bind(self._group)
        self.cadence.bind(self._group.reduce_max_each, self._group.rank)
        for tier in self.tiers:
            tier.bind(self.identity)
        if self._persistent and any(t.durability is not Durability.process for t in self._memory):
            self._writer.start()  # snapshots live in shared memory: the writer process can read them there

    def resync(self) -> None:
        """Collective, off the step path (after a restore): agree on the steps every rank holds per persistent
        tier, from which each step's persist view starts (:mod:`~lightning_resilience.checkpoint.persist_view`)."""
        self.agreement.resync({t.name: t.list_steps() for t in self._persistent})

    def _raise_failure(self, where: str) -> None:
        """Every rank is here (an agreement said a persist failed somewhere): name the failed ranks, then raise."""
        cause, self._failure = self._failure, None
        try:  # off the step path: once, when a persist failed
            ranks = self.agreement.failed_ranks(cause is not None)
        except Exception as err:  # the error every rank raises below says what matters
            ranks = f"unknown ranks ({err})"
        raise CheckpointWorkerError(
            f"a checkpoint persist failed on rank(s) [{ranks}]"
            + (f" ({type(cause).__name__}: {cause})" if cause is not None else "")
            + f"; every rank stops at {where}"
        ) from cause

    @property
    def world_size(self) -> int:
        return self.identity.world_size

    def add_meta_provider(self, provider: Callable[[int], dict[str, Any]]) -> None:
        """Merge ``provider(step)`` into the metadata of every snapshot (it lands in each tier's manifest).

        Other components record what they know about a step this way, e.g. whether it was verified clean.
        """
        self._meta_providers.append(provider)

    def add_commit_listener(self, listener: Callable[[str, int], None]) -> None:
        """Call ``listener(tier_name, step)`` for every committed write (:class:`.commits.CommitListeners`): the
        launcher learns the job's progress this way."""
        self._commits.add(listener)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:  # the same state shape is captured every step: say it once
            self._warned.add(message)
            log.warning(message)

    def _meta(self, step: int, meta: dict[str, Any] | None) -> dict[str, Any]:
        out = dict(meta or {})
        for provider in self._meta_providers:
            out.update(provider(step))
        return out

    def memory_steps(self) -> list[int]:
        """Steps this rank holds in its RAM tiers (local view)."""
        return sorted({s for t in self._memory for s in t.list_steps()})

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

        Whether a persist starts is agreed: by the view of the step's agreement when a step driver carries it
        (:attr:`agreement`), else by one small all-reduce now. Only the host copy blocks the caller; tensors for which
        ``overlap`` is true are copied in the background and must stay unchanged until :meth:`wait_snapshot` returns
        (:meth:`guard_optimizer` calls it before every optimizer step). Returns True when a snapshot was taken.

        Raises:
            CollectiveError: a rank did not come to an agreement within ``checkpoint.collective_timeout_s``.
            CheckpointWorkerError: a persist failed on some rank: raised on every rank at the next agreement.
        """
        self._hold_failure(self.collect)
        self.cadence.begin(step)  # at a review step: one small agreement on the budgeted cadences
        memory_due = [t for t in self._memory if self.cadence.due(t, step)]
        persist_due = list(
            dict.fromkeys([*self._deferred, *(t for t in self._persistent if self.cadence.due(t, step))])
        )
        if not memory_due and not persist_due:
            return False
        full_meta = self._meta(step, meta)  # the same on every rank: its verification state decides with the others
        persist_due = publishable(self.config.verified_only, persist_due, step, full_meta)
        start = self._clock()
        persist_now: list[Tier] = []
        protect: dict[str, int | None] = {}
        view = self.agreement.take()
        if persist_due:
            view = view if self.agreement.driven else self.agreement.agree_now(step)
            names = [t.name for t in persist_due]
            if view is None or not view.idle:  # every rank defers together, so every rank persists the same steps
                for tier in persist_due:
                    self.stats.tiers[tier.name].deferred += 1
                self._deferred = persist_due
            else:
                persist_now, self._deferred = persist_due, []
                protect = view.protect(names)
                self.agreement.history.attempted(names, step)
        if memory_due or persist_now:
            flat = flatten_state(state(), warn=self._warn_once)
            # the print of the live state, before the copy: what a commit and a restore of this step must find
            content = ContentPrint(step, flat.tensors) if persist_now and self.config.content_check else None
            slot = self._pool.capture(step, flat, full_meta, timeout=self.config.snapshot_timeout, overlap=overlap)
            for tier in memory_due:
                self._pool.retain(slot)
                written = tier.adopt(slot, self._pool.release)
                self.stats.tiers[tier.name].record_write(step, written.nbytes, 0.0)
            if persist_now:
                self._pool.retain(slot)
                self._worker.submit(partial(self._persist, slot, persist_now, protect, content))
            self._pool.release(slot)
            self.stats.state_bytes = slot.nbytes
            self.stats.host_bytes = self._pool.host_bytes
            self.stats.captures += 1
        elapsed = self._clock() - start  # an agreement that only deferred a persist blocked too
        self.stats.capture_seconds += elapsed
        self.stats.last_capture_seconds = elapsed
        self.stats.capture_seconds_max = max(self.stats.capture_seconds_max, elapsed)
        self.cadence.end(elapsed, snapshot=bool(memory_due), persist=bool(persist_due))
        return bool(memory_due or persist_now)

    def flush(self, step: int, state: Callable[[], Any], meta: dict[str, Any] | None = None) -> None:
        """Persist ``step`` to every persistent tier now and wait for it (end of training, before a planned stop).

        Collective like :meth:`on_step`: every rank calls it with the same step. Which tiers get the step is
        agreed: a tier every rank already has is skipped, a collective tier (peer exchange) that some rank lacks
        is written by every rank, and a rank whose earlier persist is still running makes every rank skip the
        collective tiers (its worker cannot exchange twice at once).
        """
        if not self._persistent:
            return
        idle = self.wait(hold_failure=True)
        self._deferred = []
        view = self.agreement.agree_now(step)  # collective: before any rank-local early return

        def wanted(tier: Tier) -> bool:
            if tier.collective:  # the same answer on every rank: all exchange, or none
                return view.idle and view.missing_anywhere(tier.name, step)
            return idle and step not in tier.list_steps()

        full_meta = self._meta(step, meta)
        due = publishable(self.config.verified_only, [t for t in self._persistent if wanted(t)], step, full_meta)
        if not due:
            return
        protect = view.protect([t.name for t in due])
        self.agreement.history.attempted([t.name for t in due], step)
        flat = flatten_state(state(), warn=self._warn_once)
        content = ContentPrint(step, flat.tensors) if self.config.content_check else None
        slot = self._pool.capture(step, flat, full_meta)
        self._worker.submit(partial(self._persist, slot, due, protect, content))  # takes over our slot reference
        if not self.wait():
            log.error("final persist of step %d did not finish within %s", step, self.config.drain_timeout)

    def emergency_save(self, deadline: timedelta | None = None, *, collective: bool = False) -> int | None:
        """Persist the newest RAM snapshot (the last state captured at a step boundary) to the persistent tiers,
        fastest first, within ``deadline`` (default ``checkpoint.drain_timeout_s``): for a preemption notice or an
        exception. ``collective``: every rank calls it (:class:`.emergency.EmergencySave`); otherwise it is
        rank-local. Returns the step persisted to at least one tier (or already there), or None."""
        budget = Deadline(deadline or self.config.drain_timeout)
        ok = True
        try:
            self.wait_snapshot()
            if not self._worker.wait_idle(budget.bound(self.config.drain_timeout)):
                log.error("emergency save: the running persist did not finish in time; nothing more written here")
                ok = False
            self.collect()
        except Exception as err:  # carried into the agreement (collective) instead of skipping it
            log.error("emergency save: this rank cannot write (%s: %s)", type(err).__name__, err)
            ok = False
        save = EmergencySave(self._memory, self._persistent, self._group if collective else None, budget, self.stats)
        return save.run(ok, on_commit=self._commits.tell)  # its writes bypass the worker: it tells the listeners

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
        self.cadence.blocked(waited)

    def guard_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step`` come after an in-flight snapshot copy of the tensors it is about to change;
        returns the hook handle (``.remove()`` it when done)."""
        return optimizer.register_step_pre_hook(lambda *_: self.order_snapshot())

    def _hold_failure(self, call: Callable[[], Any]) -> Any:
        """``call()``, keeping a worker failure it raises for the next agreement instead of raising it on this rank
        alone (the others would wait in that agreement for ``checkpoint.collective_timeout_s``). None if it raised."""
        try:
            return call()
        except Exception as err:
            log.error("checkpoint: a persist failed on this rank (%s); every rank stops at the next agreement", err)
            self._failure = self._failure or err
            return None

    def _persist(
        self,
        slot: HostSnapshot,
        tiers: list[Tier],
        protect: dict[str, int | None],
        content: ContentPrint | None = None,
    ) -> list[PersistResult]:
        """On the worker thread: check the staged tensors against the step's content print (not the step's state:
        committed nowhere), write the slot to each tier (every tier attempted, so a collective tier's exchange is
        entered on every rank), then apply retention; an error other than an I/O error is re-raised at the end."""
        results = []
        unexpected: BaseException | None = None
        try:
            snap = slot.view(self._writer)
            refused = content.refuse(snap) if content is not None else None
            for tier in tiers:
                start = time.perf_counter()
                deleted: list[int] = []
                if refused is not None:
                    results.append(PersistResult(tier.name, snap.step, 0, 0.0, refused))
                    continue
                try:
                    written = tier.write(snap)
                    deleted = apply_retention(tier, protect.get(tier.name))
                except OSError as err:
                    results.append(PersistResult(tier.name, snap.step, 0, time.perf_counter() - start, err))
                    continue
                except Exception as err:
                    unexpected = unexpected or err
                    continue
                results.append(
                    PersistResult(tier.name, snap.step, written.nbytes, time.perf_counter() - start, deleted=deleted)
                )
                self._commits.tell(tier.name, snap.step)
        finally:
            self._pool.release(slot)
        if unexpected is not None:
            raise unexpected
        return results

    def collect(self) -> None:
        """Fold finished persists into the stats; re-raise a worker failure on the calling (training) thread."""
        for results in self._worker.poll():
            for res in results:
                stats = self.stats.tiers[res.tier]
                if res.error is None:
                    stats.record_write(res.step, res.nbytes, res.seconds)
                    self.agreement.committed(res.tier, res.step, res.deleted)
                    continue
                error = stats.record_failure(res.error)
                log.warning("checkpoint of step %d to tier %r failed (%s); training continues, earlier checkpoints are "
                            "intact", res.step, res.tier, error)  # fmt: skip
                if self.config.on_persist_error == "raise":
                    raise CheckpointWorkerError(
                        f"persist of step {res.step} to tier {res.tier!r} failed: {error} "
                        "(checkpoint.on_persist_error=raise)"
                    ) from res.error

    def wait(self, timeout: timedelta | None = None, *, hold_failure: bool = False) -> bool:
        """Wait (bounded) for the in-flight persist; True if the worker is idle. A persist failure is raised here,
        or with ``hold_failure`` (a caller about to enter an agreement) kept for the next persist agreement, which
        raises it on every rank."""
        if not hold_failure:
            idle = self._worker.wait_idle(timeout or self.config.drain_timeout)
            self.collect()
            return idle
        idle = self._hold_failure(lambda: self._worker.wait_idle(timeout or self.config.drain_timeout))
        self._hold_failure(self.collect)
        return idle is not False

    # ------------------------------------------------------------ certified steps
    def reject(self, newer_than: int, reason: str) -> list[int]:
        """Reject every step newer than ``newer_than`` in every tier of this rank (:func:`.certify.reject_newer`);
        waits (bounded) for a persist in flight, which may be one of them. Returns the steps rejected here."""
        self.wait(hold_failure=True)
        self._deferred = []
        rejected = reject_newer(self.tiers, newer_than, reason)
        self.stats.rejected_steps = sorted({*self.stats.rejected_steps, *rejected})
        return rejected

    # ---------------------------------------------------------------- restore
    def restore(
        self,
        step: int | None = None,
        *,
        max_step: int | None = None,
        rebuild_dtensor: DTensorRebuilder | None = None,
        memory_only: bool = False,
    ) -> Restored | None:
        """Collectively pick and load the newest step that every rank can load (or exactly ``step``; at most
        ``max_step``): :class:`.restore.CollectiveRestore`. ``rebuild_dtensor`` turns saved local shards back into
        DTensors (sharded strategies). ``memory_only``: only the RAM tiers (an in-process rollback).

        Raises:
            NoValidCheckpointError: ``step`` was requested but is not loadable everywhere, or nothing valid was
                found and ``checkpoint.if_none_valid`` is ``fail``.
        """
        self.wait_snapshot()
        # a persist in flight may still read snapshot buffers that a RAM restore hands to the training state
        # a failed persist does not stop a restore: the next persist agreement reports it on every rank
        if not self.wait(self.config.drain_timeout, hold_failure=True):
            raise CheckpointWorkerError(f"persist still running after {self.config.drain_timeout}; cannot restore")
        tiers: list[Tier] = list(self._memory) if memory_only else self.tiers
        restore = CollectiveRestore(tiers, self._group, self.identity, self.config, self.stats, self._clock)
        restored = restore.run(step, max_step, rebuild_dtensor, in_process=memory_only)
        if not memory_only:
            self.resync()  # every rank is here: the persist views start from what every rank now holds
        return restored

    # --------------------------------------------------------------- teardown
    def close(self, timeout: timedelta | None = None, *, finished: bool = False) -> None:
        """Drain the in-flight persist (bounded) and stop the worker; no save outlives this call. ``finished``: the
        job is over, so RAM tiers also remove what they keep in shared memory for a restart."""
        if self._closed:
            return
        self._closed = True
        self._pool.close(self.config.snapshot_timeout)
        drained = self._worker.close(timeout or self.config.drain_timeout)
        if not drained:
            log.error("checkpoint persist did not finish within %s; its step is not committed", timeout)
        for tier in self._memory:  # after the persist: it may still read a buffer in shared memory
            tier.close(keep=not finished)
        self._writer.close(self.config.snapshot_timeout)
        self.collect()
        if self._failure is not None:  # never reported at an agreement: rank-local from here on
            cause, self._failure = self._failure, None
            raise cause
