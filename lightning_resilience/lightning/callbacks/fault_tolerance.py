"""FaultTolerance: hang detection with stack dumps, preemption handling, NVRx heartbeats and an ETTR ledger."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_resilience._lifetime import stuck_forks
from lightning_resilience.checkpoint.stats import CheckpointStats
from lightning_resilience.exit_codes import DecidedExit
from lightning_resilience.ft.config import FaultToleranceConfig
from lightning_resilience.ft.ettr import EttrLedger, EttrReport, failure_history
from lightning_resilience.ft.heartbeat import RankMonitorBridge, connect_rank_monitor
from lightning_resilience.ft.preemption import PreemptionNotice
from lightning_resilience.ft.rendezvous import prepare_restarts, restart_hazard
from lightning_resilience.ft.restart import Attempt, FaultNote, current_attempt, write_fault_note
from lightning_resilience.ft.restart_cost import process_started_at
from lightning_resilience.ft.watchdog import OUT_OF_SECTION, Hang, HangHandler, TimeoutCalibrator, Watchdog
from lightning_resilience.lightning._metrics import log_host_metrics, logging_step
from lightning_resilience.lightning.coordination import Suite
from lightning_resilience.policy import Action, Decision, Event
from lightning_resilience.rundir import RunDir

__all__ = ["FaultTolerance"]

log = logging.getLogger(__name__)

_JOIN_TIMEOUT = timedelta(seconds=10)


class FaultTolerance(Callback):
    """Detect hangs, handle preemption notices, count restarts and account for lost time.

    * A watchdog thread per rank times the sections ``setup``, ``step`` (batch start to batch end: forward,
      backward, optimizer), ``out_of_section`` (between steps), ``validation`` and ``checkpointing``. Timeouts are
      calibrated from the run's own timings and travel with the checkpoint, so a restart starts calibrated. On a
      hang the rank dumps all its threads' stacks to ``<run_dir>/stacks/`` and, when the policy says
      ``hang: dump_and_exit`` (the default) and ``exit_on_hang`` is on, exits with ``ExitCode.HANG``.
    * Under NVRx's ``ft_launcher`` the same sections and a heartbeat per step go to its rank monitor too.
    * A preemption signal on any rank travels in the next step's agreement and stops every rank at its end: by
      default (``preemption: emergency_save_and_exit``) the newest state is saved and the process ends with
      ``ExitCode.PREEMPTED``.
    * Rank 0 keeps a ledger of attempts and faults in ``<run_dir>/ft_ledger.json`` (ETTR, restarts, recomputation).

    The order of the callbacks does not matter, and no user code is needed to exit with the code::

        trainer = Trainer(callbacks=[FaultTolerance(FaultToleranceConfig(run_dir="/shared/run-17")),
                                     TieredCheckpoint(tiers)], ...)
        trainer.fit(model, datamodule=data)  # ends the process with ExitCode.PREEMPTED after a notice

    Args:
        config: timeouts, signals, NVRx mode and the run directory.
        on_hang: replaces the default hang handler (stack dump, fault note, exit); runs on the watchdog thread.
        clock: monotonic seconds for the watchdog, injectable for tests.
    """

    report_section = "fault_tolerance"

    def __init__(
        self,
        config: FaultToleranceConfig | None = None,
        *,
        on_hang: Callable[[Hang], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        prepare_restarts()  # before the process group exists: a torchrun restart must come up
        self.config = config or FaultToleranceConfig()
        self._on_hang = on_hang
        self._clock = clock
        self.run_dir: Path | None = None
        self.attempt: Attempt | None = None
        self.calibrator = self._new_calibrator()
        self.watchdog: Watchdog | None = None
        self.monitor: RankMonitorBridge | None = None
        self.monitor_reason = ""
        self.preemption: PreemptionNotice | None = None
        self.ledger: EttrLedger | None = None
        self.preempted_at: int | None = None
        self.emergency_saved: int | None = None
        self.exception: str | None = None
        self._nvrx_state: dict[str, Any] = {}
        self._suite: Suite | None = None
        self._hang_handler: HangHandler | None = None
        self._started_training = False
        self._boundaries = 0
        self._trainer: Trainer | None = None
        self._ready_at = time.time()  # the script has imported and built its callbacks: the restart breakdown's mark
        self._first_done = False

    def __getstate__(self) -> dict[str, Any]:
        # spawn launchers pickle callbacks: threads, sockets, stores and open files are per process
        state = self.__dict__.copy()
        state.update(
            watchdog=None, monitor=None, preemption=None, ledger=None, _suite=None, _hang_handler=None, _trainer=None
        )
        return state

    def _new_calibrator(self) -> TimeoutCalibrator:
        c = self.config
        return TimeoutCalibrator(
            c.initial_timeouts_s,
            safety_factor=c.safety_factor,
            warmup={"step": c.warmup_steps, OUT_OF_SECTION: c.warmup_steps},
            min_s=c.min_timeout_s,
            max_s=c.max_timeout_s,
            enabled=c.calibrate,
            sections=c.calibrated_sections,
            provisional_factor=c.provisional_factor,
        )

    @property
    def exit_code(self) -> int:
        """The code the suite ends the process with (``ExitCode.PREEMPTED`` after a handled notice; 0 if none)."""
        return int(self._suite.exit_code) if self._suite is not None else 0

    @property
    def _stopped_for_preemption(self) -> bool:
        decision = self._suite.decision if self._suite is not None else None
        return decision is not None and decision.event is Event.PREEMPTION

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        cfg = self.config
        # a callback reused for another fit starts a new attempt (its calibration is kept)
        self._started_training, self._boundaries, self._first_done = False, 0, False
        self.preempted_at = self.emergency_saved = None
        self.exception = None
        self.run_dir = RunDir.resolve(cfg.run_dir, trainer.default_root_dir).root
        self.attempt = current_attempt(trainer.global_rank, trainer.world_size)
        hazard = restart_hazard() if self.attempt.restart_count == 0 and trainer.world_size > 1 else None
        if hazard and trainer.is_global_zero:  # said before training, not after the first restart hangs
            log.warning(hazard)
        self._suite = Suite.of(trainer)
        self._suite.join(trainer, "fault_tolerance", self)
        self._suite.add_reporter(self)
        self._suite.provide_failure_history(lambda: failure_history(self.ledger.attempts) if self.ledger else None)
        self._hang_handler = HangHandler(
            self.run_dir,
            trainer.global_rank,
            self.attempt.restart_count,
            dump=cfg.dump_stacks,
            exit=cfg.exit_on_hang,
        )
        on_hang = self._on_hang or self._hang_handler
        self.watchdog = Watchdog(self.calibrator, on_hang, clock=self._clock, children=stuck_forks())
        self.watchdog.switch("setup", trainer.global_step)
        self.watchdog.start()
        self.monitor, self.monitor_reason = connect_rank_monitor(cfg.nvrx)
        log.info("rank %d: %s", trainer.global_rank, self.monitor_reason)
        if self.monitor is not None:
            self.monitor.load_state_dict(self._nvrx_state)
            self.monitor.start_section("setup")
        self.preemption = PreemptionNotice(cfg.signals, rank=trainer.global_rank)
        self._trainer = trainer
        if trainer.is_global_zero:
            self.ledger = EttrLedger(self.run_dir, interval_s=cfg.ledger_interval_s)
            self.ledger.begin_attempt(
                restart_count=self.attempt.restart_count,
                launcher=self.attempt.launcher,
                world_size=trainer.world_size,
                job_id=self.attempt.job_id,
                process_started_at=process_started_at(),
                script_ready_at=self._ready_at,
            )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # every member has attached by now: the policy's mapping is known
        if self._suite is None:
            return
        if self._hang_handler is not None:
            exits = self._suite.action_for(Event.HANG) is Action.DUMP_AND_EXIT
            self._hang_handler.exit = self.config.exit_on_hang and exits
        driver = self._suite.the_driver()
        assert self.preemption is not None
        driver.add_contributor(self.preemption)  # a notice travels in each step's agreement
        driver.add_bookkeeper(self)
        self._suite.on_rolled_back(self._rolled_back)

    def _rolled_back(self, step: int, steps_lost: int) -> None:
        if self.ledger is not None:  # rank 0's ETTR ledger: the undone steps are recomputation
            self.ledger.note_rollback(steps_lost)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # installed here, after the Trainer registered its own handlers: Lightning's SIGTERM handler runs a
        # collective from inside the signal handler on the signalled rank only, which would deadlock the others
        if self.preemption is not None:
            self.preemption.install()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.watchdog is None:
            return
        step = trainer.global_step
        if not self._started_training:
            self._started_training = True
            if self.ledger is not None:
                stats = self._checkpoint_stats()
                restored = stats is not None and stats.restored_step is not None
                self.ledger.first_step(
                    step,
                    restored_step=stats.restored_step if stats is not None else None,
                    restored_from=stats.restored_from if restored and stats is not None else None,
                    restore_s=stats.restore_seconds if restored and stats is not None else None,
                    restored_at=stats.restored_at if restored and stats is not None else None,
                )
            if self.monitor is not None:
                self.monitor.end_section("setup")
        self.watchdog.switch("step", step)
        if self.monitor is not None:
            self.monitor.start_section("step")

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.watchdog is None:
            return
        self.watchdog.switch(OUT_OF_SECTION, trainer.global_step)
        if self.monitor is not None:
            self.monitor.end_section("step")
            self.monitor.heartbeat()

    def after_step(self, step: int, decision: Decision | None) -> None:
        """The step driver's bookkeeping phase: the ledger, NVRx calibration, a preemption's stop step, metrics."""
        trainer = self._trainer
        if self.watchdog is None or trainer is None:
            return
        if decision is not None and decision.event is Event.PREEMPTION and self.preempted_at is None:
            self.preempted_at = decision.step  # agreed by every rank: the policy decided at this boundary
        if self.ledger is not None and not self._first_done:
            self._first_done = True
            self.ledger.first_step_done()
        if self.ledger is not None:
            self.ledger.heartbeat(
                step,
                checkpoint_blocking_s=self._checkpoint_blocking(trainer),
                persisted=self._persisted(trainer),
                cadences=self._cadences(),
            )
        self._boundaries += 1
        if self.monitor is not None and not self.monitor.calibrated and self._boundaries > self.config.warmup_steps:
            self.monitor.calibrate()  # collective inside NVRx: every rank reaches this same step
        if logging_step(trainer):
            log_host_metrics(trainer, self._metrics())

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.watchdog is not None and self._started_training:
            self.watchdog.switch("validation", trainer.global_step)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.watchdog is not None and self._started_training:
            self.watchdog.switch(OUT_OF_SECTION, trainer.global_step)
            if self.monitor is not None:
                self.monitor.heartbeat()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.watchdog is None:
            return
        self.watchdog.switch("checkpointing", trainer.global_step)
        if self.monitor is not None:
            self.monitor.start_section("checkpointing")
        if self.ledger is not None:
            self.ledger.save()  # the last step is on disk for the end-of-run report (heartbeat writes are throttled)
        if self.preempted_at is None or not self._stopped_for_preemption:
            return
        assert self._suite is not None
        self.emergency_saved = self._suite.emergency_saved  # saved by the suite when it decided
        if self._suite.store is None:
            log.error("preemption notice handled without a TieredCheckpoint: nothing saved")
        assert self.preemption is not None and self.attempt is not None and self.run_dir is not None
        note = FaultNote(
            kind="preemption",
            rank=trainer.global_rank,
            attempt=self.attempt.restart_count,
            step=self.preempted_at,
            detected_at=self.preemption.received_at or time.time(),
            message=f"{self.preemption.received_signal.name if self.preemption.received_signal else 'notice'}"
            f" on this rank; stopped after step {self.preempted_at}, saved step {self.emergency_saved}",
        )
        if self.ledger is not None:  # rank 0 owns the ledger and records its note there directly
            self.ledger.heartbeat(trainer.global_step, checkpoint_blocking_s=self._checkpoint_blocking(trainer))
            self.ledger.end_attempt("preempted", note if self.preemption.received else None)
        elif self.preemption.received:
            write_fault_note(self.run_dir, note)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, DecidedExit):
            return  # the end of a fit the suite stopped: recorded and closed in teardown
        self.exception = f"{type(exception).__name__}: {exception}"
        section = self.watchdog.section if self.watchdog is not None else None
        try:
            self._record_exception(trainer, section)
        finally:
            # Lightning runs no teardown hook after an exception: stop here, once the record is written (our
            # handlers stay until then: a launcher's SIGTERM to the survivors must not interrupt the write, as
            # Lightning's own handler would with a collective). The emergency save that follows
            # (TieredCheckpoint.on_exception) is rank-local and bounded by its own deadline.
            self._shutdown()

    def _record_exception(self, trainer: Trainer, section: str | None) -> None:
        if self.run_dir is None or self.attempt is None or self.exception is None:
            return
        note = FaultNote(
            kind="exception",
            rank=trainer.global_rank,
            attempt=self.attempt.restart_count,
            step=trainer.global_step,
            detected_at=time.time(),
            message=self.exception[:2000],
            section=section,
        )
        try:
            if self.ledger is not None:  # rank 0 owns the ledger and records its note there directly
                self.ledger.end_attempt("exception", note)
            else:
                write_fault_note(self.run_dir, note)
        except OSError as err:  # the training exception is what the user must see
            log.error("could not record the exception in %s: %s", self.run_dir, err)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._shutdown()
        if self.ledger is not None and self.ledger.current is not None and self.ledger.current.end_reason is None:
            self.ledger.heartbeat(trainer.global_step, checkpoint_blocking_s=self._checkpoint_blocking(trainer))
            self.ledger.end_attempt("finished")

    def _shutdown(self) -> None:
        if self.watchdog is not None:
            self.watchdog.switch(None)
            self.watchdog.stop(_JOIN_TIMEOUT)
        if self.preemption is not None:
            self.preemption.uninstall()
        if self.monitor is not None:
            self._nvrx_state = self.monitor.state_dict()
            self.monitor.close()
            self.monitor = None

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        nvrx = self.monitor.state_dict() if self.monitor is not None else self._nvrx_state
        return {"calibration": self.calibrator.state_dict(), "nvrx": nvrx}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.calibrator.load_state_dict(state_dict.get("calibration", {}))
        self._nvrx_state = dict(state_dict.get("nvrx") or {})
        if self.monitor is not None:
            self.monitor.load_state_dict(self._nvrx_state)
        if self.watchdog is not None:
            self.watchdog.poke()  # the open section (setup) is now judged by the loaded timeout

    # ------------------------------------------------------------------ report
    def _checkpoint_stats(self) -> CheckpointStats | None:
        store = self._suite.store if self._suite is not None else None
        return store.stats if store is not None else None

    def _checkpoint_blocking(self, trainer: Trainer) -> float | None:
        stats = self._checkpoint_stats()
        return float(stats.capture_seconds) if stats is not None else None

    def _persisted(self, trainer: Trainer) -> dict[str, int | None]:
        """The newest committed step of each persistent (non-RAM) checkpoint tier."""
        store = self._suite.store if self._suite is not None else None
        return store.persisted_steps() if store is not None else {}

    def _cadences(self) -> list[tuple[int, str, int, str]]:
        """The cadences the checkpoint engine's cost budget chose so far, and why."""
        store = self._suite.store if self._suite is not None else None
        return store.cadence_changes() if store is not None else []

    def ettr(self) -> EttrReport | None:
        """Time accounting so far (global rank 0 only; None elsewhere)."""
        return self.ledger.report() if self.ledger is not None else None

    def _metrics(self) -> dict[str, float]:
        timeouts = self.calibrator.timeouts()
        out = {
            "resilience/ft/step_timeout_s": timeouts.get("step", 0.0),
            "resilience/ft/out_of_section_timeout_s": timeouts.get(OUT_OF_SECTION, 0.0),
            "resilience/ft/restart_count": float(self.attempt.restart_count if self.attempt else 0),
        }
        report = self.ettr()
        if report is not None:
            out.update(
                {
                    "resilience/ft/ettr": report.ettr or 0.0,
                    "resilience/ft/restart_gap_s": report.restart_gap_s,
                    "resilience/ft/recompute_s": report.recompute_s,
                    "resilience/ft/checkpoint_blocking_s": report.checkpoint_blocking_s,
                    "resilience/ft/detection_s": report.detection_s,
                }
            )
        return out

    def report(self) -> dict[str, Any]:
        """JSON-able figures for the machine-readable end-of-run report."""
        ettr = self.ettr()
        return {
            "attempt": self.attempt.__dict__ if self.attempt else None,
            "timeouts_s": self.calibrator.timeouts(),
            "calibrated": {s: self.calibrator.calibrated(s) for s in self.calibrator.timeouts()},
            "nvrx": self.monitor_reason,
            "preempted_at": self.preempted_at,
            "emergency_saved": self.emergency_saved,
            "exception": self.exception,
            "exit_code": self.exit_code,
            "ettr": ettr.to_json() if ettr else None,
            "attempts": [a.__dict__ for a in self.ledger.attempts] if self.ledger else None,
        }

    def _basis_note(self, section: str) -> str:
        return "" if self.calibrator.calibrated(section) else f" ({self.calibrator.basis(section)})"

    def summary(self) -> str:
        """A short human-readable account: timeouts, restarts and their causes, and where the time went."""
        t = self.calibrator.timeouts()
        lines = [
            "fault tolerance: timeouts " + ", ".join(f"{s} {v:.0f}s{self._basis_note(s)}" for s, v in t.items()),
            f"  {self.monitor_reason or 'NVRx rank monitor: not set up'}",
        ]
        if self.preempted_at is not None:
            lines.append(f"  preempted after step {self.preempted_at}; emergency save of step {self.emergency_saved}")
        report = self.ettr()
        if report is not None:
            lines += [f"  {line}" for line in report.describe()]
        return "\n".join(lines)
