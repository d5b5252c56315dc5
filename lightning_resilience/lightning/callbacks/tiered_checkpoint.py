"""TieredCheckpoint: a per-step snapshot in host RAM, persisted in the background to slower tiers, and automatic
resume from the newest step every rank can load."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from typing_extensions import override

from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.manager import CheckpointManager, CheckpointStats, Restored
from lightning_resilience.checkpoint.progress import record_progress
from lightning_resilience.checkpoint.rng import capture_rng_states, restore_rng_states
from lightning_resilience.checkpoint.tier import Durability, Tier
from lightning_resilience.checkpoint.tree import storage_ptr
from lightning_resilience.exit_codes import DecidedExit
from lightning_resilience.ft.rendezvous import prepare_restarts
from lightning_resilience.lightning._metrics import log_host_metrics, logging_step
from lightning_resilience.lightning._train_data import TrainDataPosition
from lightning_resilience.lightning._trainer_state import (
    callback_state,
    discard_pending_checkpoint,
    dump_trainer_state,
    pending_checkpoint_step,
    restore_trainer_state,
)
from lightning_resilience.lightning.coordination import Suite
from lightning_resilience.rundir import RunDir

__all__ = ["TieredCheckpoint"]

log = logging.getLogger(__name__)


class TieredCheckpoint(Checkpoint):
    """Checkpoint every step to RAM, persist to disk (and beyond) on each tier's cadence, resume automatically.

    A Lightning :class:`~lightning.pytorch.callbacks.Checkpoint`: Lightning runs it after the other callbacks and
    adds no default ``ModelCheckpoint`` next to it (leave ``enable_checkpointing`` at its default).

    Example::

        Trainer(callbacks=[TieredCheckpoint(tiers=[MemoryTier(every_n_steps=1, keep=2),
                                                   LocalTier("/nvme/ckpt", every_n_steps=20, keep=3)])])

    Resuming inside an epoch is exact (bitwise) with the user's own train loaders: a map-style ``DataLoader`` or
    torchdata ``StatefulDataLoader`` (any sampler, any ``num_workers``) continues at the next batch, skipping at the
    level of indices; a ``StatefulDataLoader`` over an iterable dataset with state continues from its own state,
    taken in step with the batches trained on; another loader with ``state_dict`` keeps its own state; what cannot
    be made exact (a loader over an iterable dataset without state, random draws in the workers of an iterable
    dataset) is named in a warning at fit start.

    Args:
        tiers: where snapshots go (tiers, or their config dataclasses); each has its own ``every_n_steps`` and
            ``keep``.
        resume: ``"auto"`` (newest step valid on every rank; with ``fit(ckpt_path=...)``, the newer of the two),
            ``"never"``, or a step number (then ``ckpt_path``, if given, wins); a shorthand for
            ``config.resume`` (default: ``config.resume``, itself ``"auto"`` by default). Giving both with different
            values is an error.
        config: engine behaviour (error policy, timeouts, host buffers, resume).

    Raises:
        ValueError: ``resume`` and ``config.resume`` disagree.
    """

    def __init__(
        self, tiers: Sequence[Any], resume: str | int | None = None, config: CheckpointConfig | None = None
    ) -> None:
        prepare_restarts()  # before the process group exists: a torchrun restart must come up
        base = config or CheckpointConfig()
        if resume is not None and config is not None and str(resume) != config.resume != "auto":
            raise ValueError(
                f"checkpoint.resume={resume!s} conflicts with checkpoint.config.resume={config.resume}: set one"
            )
        self.config = CheckpointConfig(**{**base.__dict__, "resume": base.resume if resume is None else str(resume)})
        # a tier's config dataclass (what Hydra builds from ``resilience/checkpoint``) stands for its tier
        self.tiers: list[Tier] = [
            t if isinstance(t, Tier) or not callable(getattr(t, "build", None)) else t.build() for t in tiers
        ]
        self.manager: CheckpointManager | None = None
        self._last_step = -1
        self._pending_rng: dict[str, Any] | None = None
        self._guards: list[Any] = []
        self._data = TrainDataPosition()
        self._blocking_logged = 0.0
        self._captures_logged = 0
        self.restores = 0
        self.rollbacks = 0
        """In-process rollbacks applied in this process."""
        self.discarded_suspect: list[int] = []
        """Steps newer than a restore bound (a corrupt state found by SDC), deleted on this rank at restore."""
        self._suite: Suite | None = None
        self._fit: tuple[Trainer, LightningModule] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # spawn launchers pickle callbacks: the engine (threads, locks, buffers) is per process and rebuilt in setup
        state = self.__dict__.copy()
        state["manager"], state["_guards"], state["_data"] = None, [], TrainDataPosition()
        state["_suite"], state["_fit"] = None, None
        return state

    @property
    def stats(self) -> CheckpointStats:
        if self.manager is None:
            raise RuntimeError("TieredCheckpoint has not been set up by a Trainer yet")
        return self.manager.stats

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.manager = CheckpointManager(self.tiers, self.config)
        self._suite = Suite.of(trainer)
        self._suite.join(trainer, "checkpoint", self, timeout=self.config.collective_timeout)
        self._suite.set_store(self)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self.manager is not None and self._suite is not None
        # collective over the job's ranks, in the order of the callbacks: the same on every rank
        self.manager.setup(side=self._suite.side("checkpoint", self.config.collective_timeout))
        launched = RunDir.from_environment()
        if launched is not None:  # the launcher judges progress from what every tier committed, wherever it is
            record_progress(self.manager, launched)
        driver = self._suite.the_driver()
        driver.add_contributor(self.manager.agreement)
        self.manager.agreement.driven = True
        driver.add_snapshotter(self)
        self._fit = (trainer, pl_module)
        self._last_step = trainer.global_step
        self.manager.cadence.count_detectors(self._suite.detector_seconds)  # the budget is one for the whole suite
        history = self._suite.failure_history()  # rank 0's ledger: the MTBF the budgeted cadences assume
        if history is not None:
            self.manager.cadence.note_failures(*history)
        for line in self.manager.cadence.describe():
            rank_zero_log(trainer, "checkpoint cadence: %s", line)
        if self.config.overlap_copy:
            # a snapshot's background copy must land before the optimizer changes what it reads
            self._guards = [self.manager.guard_optimizer(opt) for opt in trainer.optimizers]
        if self.config.resume == "never":
            return
        pending = pending_checkpoint_step(trainer) if trainer.ckpt_path is not None else None
        if trainer.ckpt_path is not None and (pending is None or self.config.resume_step is not None):
            return  # fit(ckpt_path=...) that cannot be compared (restored after setup), or a chosen step: it wins
        bound = self._suite.restore_bound(trainer)  # collective: a corrupt state was found by an earlier attempt
        # sharded strategies rebuild DTensors on their device mesh
        rebuild = getattr(trainer.strategy, "rebuild_dtensor", None)
        max_step = bound.max_step if bound is not None else None
        if bound is not None:
            rank_zero_log(
                trainer, "restoring at most step %d: the state was found corrupt at step %d (%s)",
                bound.max_step, bound.detected_at, bound.reason,
            )  # fmt: skip
        restored = self.manager.restore(self.config.resume_step, max_step=max_step, rebuild_dtensor=rebuild)
        if bound is not None:
            self._discard_suspect(trainer, bound.max_step)
            self.manager.resync()  # every rank deleted its suspect steps
        if restored is None:
            rank_zero_log(trainer, "no checkpoint to resume from: starting at step %d", trainer.global_step)
            return
        if pending is not None:
            if restored.step <= pending:
                rank_zero_log(trainer, "ckpt_path (step %d) is not older than our step %d: resuming from ckpt_path",
                              pending, restored.step)  # fmt: skip
                self.manager.stats.restored_step = self.manager.stats.restored_from = None
                return
            # fit(ckpt_path=...) names an older state (NeMo's resume_if_exists, a relaunched script): the newest wins
            rank_zero_log(trainer, "our step %d is newer than ckpt_path (step %d): resuming from it", restored.step,
                          pending)  # fmt: skip
            discard_pending_checkpoint(trainer)
        restore_trainer_state(trainer, restored.state)
        self._last_step = restored.step
        self.restores += 1
        rank_zero_log(trainer, "resumed from step %d (tier %r, %.3fs)", restored.step, restored.tier, restored.seconds)

    def _discard_suspect(self, trainer: Trainer, max_step: int) -> None:
        """Delete this rank's steps newer than ``max_step`` from every tier, then (all ranks done) the bound."""
        assert self.manager is not None and self._suite is not None
        for tier in self.manager.tiers:
            for step in tier.list_steps():
                if step > max_step:
                    tier.delete(step)
                    self.discarded_suspect.append(step)
        if self.discarded_suspect:
            log.warning("deleted suspect steps %s (newer than the verified step %d)", self.discarded_suspect, max_step)
        self._suite.barrier("discard_suspect")
        if trainer.is_global_zero:
            self._suite.clear_restore_bound(trainer)
        self._suite.barrier("restore_bound_cleared")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # applied here, after the sanity check and the dataloader set-up, right before the first resumed step
        if self._pending_rng is not None:
            restore_rng_states(self._pending_rng)
            self._pending_rng = None
        # the train loaders exist now, Lightning's sampler injected: continue the saved epoch at its next batch
        self._data.attach(trainer)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._data.start_epoch(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._data.record(trainer)  # validation inside an epoch draws from the generators the next batch draws from

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # a stateful loader's state, for this step's snapshot (taken by the step driver, after every callback's
        # on_train_batch_end) or the next ones
        self._data.record(trainer)

    def snapshot(self, step: int) -> None:
        """The step driver's snapshot phase: capture the state of ``step`` (the driver skips a suspect state)."""
        if self._fit is not None and self._suite is not None:
            self._snapshot(*self._fit, self._suite.batch_idx)

    def _snapshot(self, trainer: Trainer, pl_module: LightningModule, batch_idx: int) -> None:
        assert self.manager is not None
        step = trainer.global_step
        if step == self._last_step:
            return  # already captured
        self._last_step = step
        taken = self.manager.on_step(
            step,
            lambda: dump_trainer_state(trainer),
            meta={"epoch": trainer.current_epoch, "batch_idx": batch_idx},
            overlap=_changed_only_by_optimizer(trainer, pl_module) if self._guards else None,
        )
        self._captures_logged += int(taken)
        if self._captures_logged and logging_step(trainer):
            stats = self.manager.stats
            # everything that blocked training since the last log (captures and waits for copies), per snapshot
            blocked, self._blocking_logged = stats.capture_seconds - self._blocking_logged, stats.capture_seconds
            log_host_metrics(
                trainer,
                {
                    "resilience/checkpoint/blocking_ms": blocked * 1e3 / self._captures_logged,
                    "resilience/checkpoint/persist_failures": sum(t.failures for t in stats.tiers.values()),
                },
            )
            self._captures_logged = 0

    @property
    def _known_corrupt(self) -> bool:
        return self._suite is not None and self._suite.state_suspect()

    # ------------------------------------------------------------------ what the suite may ask (CheckpointStore)
    def committed_steps(self) -> dict[str, list[int]]:
        assert self.manager is not None
        self.manager.wait(hold_failure=True)  # a persist in flight may be the step asked for; an agreement follows
        return self.manager.steps()

    def memory_steps(self) -> list[int]:
        return self.manager.memory_steps() if self.manager is not None else []

    def persisted_steps(self) -> dict[str, int | None]:
        """The newest committed step of each tier that outlives the process."""
        if self.manager is None:
            return {}
        stats = self.manager.stats.tiers
        return {t.name: stats[t.name].last_step for t in self.manager.tiers if t.durability is not Durability.process}

    def cadence_changes(self) -> list[tuple[int, str, int, str]]:
        if self.manager is None:
            return []
        return [(c.step, c.tier, c.every_n_steps, c.reason) for c in self.manager.cadence.changes]

    def add_meta_provider(self, provider: Callable[[int], dict[str, Any]]) -> None:
        assert self.manager is not None
        self.manager.add_meta_provider(provider)

    def reject_after(self, step: int, reason: str) -> list[int]:
        assert self.manager is not None
        return self.manager.reject(step, reason)

    def report_section(self, blocking_timeline: list[tuple[int, float]]) -> dict[str, Any]:
        """The checkpoint section of the end-of-run report (``blocking_timeline``: (step, seconds blocked))."""
        from lightning_resilience.report import checkpoint_section  # imported when needed: not on a restart's path

        assert self.manager is not None
        return checkpoint_section(
            self.manager.stats,
            self.manager.tiers,
            restores=self.restores,
            blocking_timeline=blocking_timeline,
            cadence=self.manager.cadence.report(),
        )

    def restore_memory(self, step: int) -> Restored:
        assert self.manager is not None
        restored = self.manager.restore(step, memory_only=True)  # collective; raises if not loadable everywhere
        assert restored is not None
        return restored

    def rollback_to(self, trainer: Trainer, restored: Restored, skip_ahead: int | None) -> list[Any]:
        """Apply ``restored`` (a RAM snapshot) in the running process from ``on_train_batch_end``: every part of the
        Trainer's state, the RNG streams and the train loaders' position; the batch handed out ``skip_ahead`` batches
        after the restored position is left out of its epoch (None: nothing). Returns, per train loader, the
        indices of the batch left out (None where unknown)."""
        restore_trainer_state(trainer, restored.state, in_flight=True)
        if self._pending_rng is not None:
            restore_rng_states(self._pending_rng)
            self._pending_rng = None
        self._last_step = -1  # RAM handed the step over: the step driver captures the restored state again
        self.rollbacks += 1
        return self._data.rewind(trainer, skip_ahead)

    def persist_now(self, trainer: Trainer, meta: dict[str, Any] | None = None) -> None:
        """Collective: persist the current step to every persistent tier and wait (a planned stop)."""
        assert self.manager is not None
        step = trainer.global_step
        self.manager.flush(
            step, lambda: dump_trainer_state(trainer), meta={"epoch": trainer.current_epoch, **(meta or {})}
        )
        self._last_step = step

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.manager is not None and self.config.persist_on_train_end and not self._known_corrupt:
            self.persist_now(trainer)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, DecidedExit):
            return  # the end of a fit the suite stopped: everything was saved and closed in teardown
        if self.manager is not None and self.config.save_on_exception:
            try:
                saved = self.manager.emergency_save(self.config.emergency_timeout)
                if saved is not None:
                    log.warning("training raised %s: step %d saved from RAM", type(exception).__name__, saved)
            except Exception as err:  # the training exception is what the user must see
                log.error("emergency save after %s failed: %s", type(exception).__name__, err)
        self._shutdown()

    def emergency_save(self, collective: bool = True) -> int | None:
        """Persist the newest RAM snapshot now (a preemption notice agreed by all ranks); returns its step."""
        if self.manager is None:
            return None
        return self.manager.emergency_save(self.config.emergency_timeout, collective=collective)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            # a fit that ended without a decided stop (or a corrupt state) is the end of the job: nothing is kept
            suite = self._suite
            self._shutdown(finished=suite is None or (suite.decision is None and suite.corrupt is None))

    def _shutdown(self, finished: bool = False) -> None:
        self._fit = None
        self._data.detach()
        for guard in self._guards:
            guard.remove()
        self._guards = []
        if self.manager is not None:
            self.manager.close(finished=finished)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        # RNG streams of this rank travel with every checkpoint Lightning takes while we are attached
        return {"rng": capture_rng_states(), "restores": self.restores, "data": self._data.state_dict()}

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # before Lightning restores its loops: loaders whose position we restore get nothing of their own state
        mine = callback_state(checkpoint, self.state_key)
        TrainDataPosition.supersede(checkpoint, None if mine is None else mine.get("data"))

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_rng = state_dict.get("rng")
        self.restores = int(state_dict.get("restores", 0))
        self._data.load_state_dict(state_dict.get("data"))

    def summary(self) -> str:
        """A short human-readable account of what was saved and restored, and at what cost."""
        if self.manager is None:
            return "tiered checkpoint: not run"
        s = self.manager.stats
        lines = [
            f"tiered checkpoint: {s.captures} snapshots of {s.state_bytes / 2**20:.1f} MiB, blocking "
            f"mean {s.capture_seconds_mean * 1e3:.2f} ms, max {s.capture_seconds_max * 1e3:.2f} ms",
        ]
        for name, t in s.tiers.items():
            mean = t.seconds / t.writes if t.writes else 0.0
            lines.append(
                f"  tier {name:<8} writes {t.writes:>5}  failures {t.failures}  deferred {t.deferred}  "
                f"last step {t.last_step}  mean write {mean * 1e3:.1f} ms"
            )
        if s.restored_step is not None:
            lines.append(
                f"  restored step {s.restored_step} from tier {s.restored_from!r} in {s.restore_seconds * 1e3:.1f} ms"
            )
        for msg in s.skipped_corrupt:
            lines.append(f"  skipped: {msg}")
        if self.manager.cadence.budgeted:
            lines += [f"  cadence: {line}" for line in self.manager.cadence.describe()]
        return "\n".join(lines)


def _changed_only_by_optimizer(trainer: Trainer, pl_module: LightningModule) -> Callable[[torch.Tensor], bool]:
    """Storages of parameters and optimizer state: they change only inside an optimizer step."""
    storages = {storage_ptr(p) for p in pl_module.parameters()}
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            storages.update(storage_ptr(v) for v in state.values() if isinstance(v, torch.Tensor))
    storages.discard(0)
    return lambda t: storage_ptr(t) in storages


def rank_zero_log(trainer: Trainer, msg: str, *args: Any) -> None:
    if trainer.is_global_zero:
        log.info(msg, *args)
