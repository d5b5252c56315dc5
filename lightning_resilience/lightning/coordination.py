"""The suite of one Trainer: the step driver its callbacks register with, and what the driver's decisions do.

Every callback of the suite joins ``Suite.of(trainer)`` in its ``setup`` (by role: checkpoint, fault tolerance,
straggler, SDC, policy, report) and, at fit start, registers framework-free components with the one
:class:`~lightning_resilience.step.driver.StepDriver`: contributors to the step's agreement, a snapshotter,
finishers and bookkeepers. One callback of the suite's own, :class:`StepPath`, added to the Trainer at the first
join and kept last, runs the driver: it issues the step's agreement at the batch start and runs the step end in
its written order (finish, agree, act, snapshot, stop, bookkeeping) at the batch end. The order of the callbacks
in the Trainer does not matter, and no callback calls or reads another. The suite is the driver's
:class:`~lightning_resilience.step.driver.Actor`: it rolls back in place, persists and stops, and logs.

The exit contract: when a decision stopped the job (or SDC found the state corrupt, whatever the policy did
about it), the last member's ``teardown`` raises :class:`~lightning_resilience.exit_codes.DecidedExit` with the
decided code, so the process ends with it without a line of user code (``PolicyConfig.exit_after_fit``). A
corrupt verdict also leaves a restore bound in the run directory: the next attempt restores at most the newest
verified step and deletes the newer, suspect ones.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_resilience.collective import SideGroup
from lightning_resilience.exit_codes import DecidedExit, ExitCode
from lightning_resilience.lightning._members import CheckpointStore, Reporting
from lightning_resilience.lightning._step_path import StepPath, act_for
from lightning_resilience.lightning.rollback import InProcessRollback
from lightning_resilience.policy import Action, Decision, Event, PolicyConfig, Verdict
from lightning_resilience.rundir import RunDir
from lightning_resilience.step.channels import Channels
from lightning_resilience.step.driver import StepDriver

if TYPE_CHECKING:
    from lightning_resilience.lightning.callbacks.fault_tolerance import FaultTolerance
    from lightning_resilience.lightning.callbacks.policy import ResiliencePolicy
    from lightning_resilience.lightning.callbacks.sdc import SDCVerification
    from lightning_resilience.lightning.callbacks.straggler import StragglerDetection
    from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint

__all__ = ["RESTORE_BOUND_FILE", "CheckpointStore", "Reporting", "RestoreBound", "Suite"]

log = logging.getLogger(__name__)

RESTORE_BOUND_FILE = RunDir(Path()).restore_bound.name
"""Written to the run directory when the state was found corrupt: the next attempt restores at most its step."""

_NO_BOUND = 2**62


@dataclass(frozen=True)
class RestoreBound:
    """The newest step a restart may restore, and why (a corrupt state found at ``detected_at``)."""

    max_step: int
    detected_at: int
    reason: str


class Suite:
    """The resilience callbacks attached to one Trainer, their step driver, and the decision they led to."""

    _registry: ClassVar[weakref.WeakKeyDictionary[Trainer, Suite]] = weakref.WeakKeyDictionary()
    report_section = "resilience_policy"

    def __init__(self) -> None:
        # the members by role, for the user's own code (members reach each other only through the protocols)
        self.checkpoint: TieredCheckpoint | None = None
        self.store: CheckpointStore | None = None
        self.fault_tolerance: FaultTolerance | None = None
        self.straggler: StragglerDetection | None = None
        self.sdc: SDCVerification | None = None
        self.policy: ResiliencePolicy | None = None
        self.reporters: list[Reporting] = []
        self._members: list[Callback] = []
        self._path: StepPath | None = None
        self._timeouts: list[timedelta] = []
        self._policy_config: PolicyConfig | None = None
        self._channels: Channels | None = None
        self.driver: StepDriver | None = None
        self.corrupt: Verdict | None = None
        """The first verdict that found the training state corrupt in this fit, or None."""
        self.emergency_saved: int | None = None
        self._rollback_pending = False
        self._rollback: InProcessRollback | None = None
        self._rolled_back: list[Callable[[int, int], None]] = []
        self._last_end: int | None = None
        self.batch_idx = 0
        self._record_dir: Path | None = None
        self._failure_history: Callable[[], tuple[float, int] | None] | None = None
        self._costs: list[Callable[[], float]] = []
        self._trainer: weakref.ref[Trainer] | None = None
        """The index of the batch the current step boundary follows (snapshot metadata)."""
        self._fit_over = False

    @classmethod
    def of(cls, trainer: Trainer) -> Suite:
        """The suite of ``trainer`` (created on first use)."""
        suite = cls._registry.get(trainer)
        if suite is None:
            suite = cls._registry[trainer] = cls()
        return suite

    # ------------------------------------------------------------------ membership
    def join(self, trainer: Trainer, role: str, member: Callback, *, timeout: timedelta | None = None) -> None:
        """A member joins in its ``setup`` (every member before any ``on_fit_start``): ``role`` is one of
        checkpoint, fault_tolerance, straggler, sdc, policy, report; ``timeout`` bounds its agreements."""
        if self._path is None or self._path not in trainer.callbacks:  # type: ignore[attr-defined]
            self._path = StepPath(self)
            trainer.callbacks.append(self._path)  # type: ignore[attr-defined]
        if role != "report":
            current = getattr(self, role)
            if current is not None and current is not member:
                raise ValueError(
                    f"the Trainer has two {role} callbacks ({type(current).__name__} and {type(member).__name__}): "
                    "keep one (the suite enabled from the environment adds only what the Trainer lacks)"
                )
            setattr(self, role, member)
        if self._fit_over:  # the Trainer fits again: a new attempt's decisions
            self._reset()
        if member not in self._members:
            self._members.append(member)
        if timeout is not None:
            self._timeouts.append(timeout)

    def set_policy(self, config: PolicyConfig) -> None:
        self._policy_config = config

    def set_store(self, store: CheckpointStore) -> None:
        self.store = store

    def add_reporter(self, reporting: Reporting) -> None:
        """A component of your own contributes a section to the end-of-run report (call it from ``setup``)."""
        if reporting not in self.reporters:
            self.reporters.append(reporting)

    def on_rolled_back(self, listener: Callable[[int, int], None]) -> None:
        """``listener(restored_step, steps_lost)`` is called on every rank after each in-process rollback."""
        self._rolled_back.append(listener)

    def _reset(self) -> None:
        self._fit_over = False
        self.corrupt, self.emergency_saved = None, None
        if self._rollback is not None:
            self._rollback.close()
        self._rollback, self._rollback_pending = None, False
        self._rolled_back = []
        self._costs = []
        if self._channels is not None:
            self._channels.close()
        self._channels, self.driver, self._last_end = None, None, None

    # ------------------------------------------------------------------ channels and driver
    @property
    def policy_config(self) -> PolicyConfig:
        return self._policy_config or PolicyConfig()

    def action_for(self, event: Event) -> Action:
        return Action(self.policy_config.action_for(event.value))

    def channels(self) -> Channels:
        """The side groups and the step driver, made at the first call: every member calls it from
        ``on_fit_start``, when every member has joined (collective: every rank gets there in the same order)."""
        if self._channels is None:
            policy = self.policy_config
            self._channels = Channels(
                self._timeouts, timedelta(seconds=policy.timeout_s), fanout=policy.agreement_fanout
            )
            self.driver = StepDriver(policy, self._channels.agreement)
            self.driver.add_witness(self)
            self.driver.add_bookkeeper(self)
            self.driver.on_post(self._posted)
        return self._channels

    def side(self, name: str, timeout: timedelta | None = None) -> SideGroup:
        """A view of the suite's side group for the training thread's agreements off the step path."""
        return self.channels().side(name, timeout or timedelta(seconds=self.policy_config.timeout_s))

    def the_driver(self) -> StepDriver:
        self.channels()
        assert self.driver is not None
        return self.driver

    def provide_failure_history(self, provider: Callable[[], tuple[float, int] | None]) -> None:
        """The fault-tolerance member gives the run's failure history (from its ledger on global rank 0)."""
        self._failure_history = provider

    def count_cost(self, spent_s: Callable[[], float]) -> None:
        """A detector's training-thread seconds so far in this fit (cumulative), counted against the cost budget:
        the checkpoint tiers the budget decides get what the detectors leave of it."""
        self._costs.append(spent_s)

    def detector_seconds(self) -> float:
        """Every detector's training-thread seconds so far in this fit."""
        return sum(spent() for spent in self._costs)

    def failure_history(self) -> tuple[float, int] | None:
        """The run's wall-clock seconds so far and the attempts that ended in a fault (global rank 0; None elsewhere,
        or without fault tolerance)."""
        return self._failure_history() if self._failure_history is not None else None

    # ------------------------------------------------------------------ posting
    def post(
        self, trainer: Trainer, verdict: Verdict, *, at_least: Action | None = None, agreed: bool = False
    ) -> Action:
        """Record a detector's verdict; returns the action it leads to. ``agreed``: every rank posts it at this
        step (decided at this step's end); otherwise it is agreed in the next step's round and decided then.

        ``at_least`` raises the mapped action (e.g. SDC's ``stop_on_suspect``: never less than a rollback).
        """
        self._trainer = weakref.ref(trainer)
        return self.the_driver().post(verdict, at_least=at_least, agreed=agreed)

    def _posted(self, verdict: Verdict, action: Action, agreed: bool) -> None:
        if action is Action.ROLLBACK_IN_PROCESS:
            # the snapshot of this step would hold the state the rollback undoes (agreed verdicts only: then every
            # rank skips it, and a persist due now is deferred alike)
            self._rollback_pending = self._rollback_pending or agreed
        elif verdict.event in (Event.SDC_MISMATCH, Event.NONFINITE):
            trainer = self._trainer() if self._trainer is not None else None
            if trainer is not None:
                self.mark_corrupt(trainer, verdict)

    def mark_corrupt(self, trainer: Trainer, verdict: Verdict) -> None:
        """The training state is corrupt (the first such verdict of the fit holds): exit code SDC at the end of
        ``fit``, and a restore bound for the next attempt."""
        if self.corrupt is None:
            self.corrupt = verdict
            self._write_restore_bound(trainer, verdict)

    def in_process(self) -> InProcessRollback:
        """The in-process rollback of this fit (made at its first use, from the policy's ``rollback`` config)."""
        if self._rollback is None:
            self._rollback = InProcessRollback(self.policy_config.rollback)
        return self._rollback

    @property
    def decision(self) -> Decision | None:
        """The decision that stopped the job (the first one that did), or None."""
        return self.driver.decision if self.driver is not None else None

    # ------------------------------------------------------------------ the step path (run by StepPath)
    def train_start(self, trainer: Trainer) -> None:
        self._trainer = weakref.ref(trainer)
        self.channels()  # made by a member's on_fit_start already, or here (every rank at the same point)
        self._last_end = trainer.global_step

    def batch_start(self, trainer: Trainer) -> None:
        """The step's round is issued (once per optimizer step)."""
        if self.driver is not None:
            self.driver.begin_step(trainer.global_step)

    def batch_end(self, trainer: Trainer, pl_module: LightningModule, batch_idx: int) -> None:
        """The driver's step end, at a step boundary (not between the micro-batches of one step)."""
        step = trainer.global_step
        if self.driver is None or step == self._last_end:
            return
        self.batch_idx = batch_idx
        self.driver.end_step(step, act_for(self, trainer, pl_module))
        self._last_end = trainer.global_step  # a rollback moved it back

    def train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Settle what was posted since the last round (one agreement, off the step path)."""
        if self.driver is not None:
            self.driver.settle(trainer.global_step, act_for(self, trainer, pl_module))

    def abort(self) -> None:
        """Training raised: stop the agreement thread (every member is being torn down)."""
        if self._channels is not None:
            self._channels.close()

    def state_suspect(self) -> bool:
        """The state is corrupt, or an agreed verdict is about to undo it: not worth a snapshot."""
        return self.corrupt is not None or self._rollback_pending

    def after_step(self, step: int, decision: Decision | None) -> None:
        self._rollback_pending = False

    def persist_now(self, trainer: Trainer, *, reason: str) -> bool:
        """Collective: persist the current step to every persistent tier and wait (every rank at one boundary)."""
        if self.store is None:
            if trainer.is_global_zero:
                log.warning("resilience: stopping without a checkpoint (no TieredCheckpoint in the Trainer)")
            return False
        self.store.persist_now(trainer, {"reason": reason})
        return True

    def rolled_back(self, restored: int, steps_lost: int) -> None:
        self._rollback_pending = False  # the restored state is good: the step driver captures it
        for listener in self._rolled_back:
            listener(restored, steps_lost)

    # ------------------------------------------------------------------ exit
    @property
    def exit_code(self) -> ExitCode:
        """The code the process should end with: the stopping decision's, SDC for a corrupt state, else OK."""
        if self.decision is not None:
            return self.decision.exit_code
        if self.corrupt is not None:
            return ExitCode.SDC
        return ExitCode.OK

    def fit_end(self, trainer: Trainer) -> None:
        """After every member's ``teardown`` (StepPath is the last callback): end the process if decided."""
        if self._fit_over:
            return
        self._fit_over = True
        if self._channels is not None:
            self._channels.close()
        code = self.exit_code
        if code is ExitCode.OK or not self.policy_config.exit_after_fit:
            return
        decision = self.decision
        reason = (
            f"{decision.action.value} for {decision.event.value} at step {decision.step}"
            if decision is not None
            else f"corrupt state found at step {self.corrupt.step if self.corrupt else '?'}"
        )
        rank_zero_info(f"lightning_resilience: ending the process with exit code {int(code)} ({code.name}): {reason}")
        # the process group goes before interpreter exit: left to finalisation, gloo's threads can abort the process
        # (SIGABRT) and the launcher would see 134 instead of the decided code
        atexit.register(_destroy_process_group)
        raise DecidedExit(code, reason)

    # ------------------------------------------------------------------ restore bound
    def set_record_dir(self, path: str | os.PathLike[str]) -> None:
        """Where the suite keeps records that outlive an attempt (a member's configured run directory)."""
        self._record_dir = Path(path)

    def record_dir(self, trainer: Trainer) -> Path:
        """Where the suite keeps records that outlive an attempt: the directory a member set (SDC's run_dir), else
        the launcher's, else <default_root_dir>/resilience (:meth:`RunDir.resolve`)."""
        return RunDir.resolve(self._record_dir, trainer.default_root_dir).root

    def _write_restore_bound(self, trainer: Trainer, verdict: Verdict) -> None:
        # every rank writes the same record: the run directory may be node-local
        path = RunDir(self.record_dir(trainer)).restore_bound
        record = {
            "max_step": verdict.verified_step if verdict.verified_step is not None else 0,
            "detected_at": verdict.step,
            "reason": verdict.detail,
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{trainer.global_rank}.tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)
        except OSError as err:
            log.error("could not write the restore bound %s: %s (a restart may restore a corrupt step)", path, err)

    def restore_bound(self, trainer: Trainer) -> RestoreBound | None:
        """Collective: the bound every rank agrees on (the lowest any rank's record names), or None."""
        path = RunDir(self.record_dir(trainer)).restore_bound
        record: dict[str, Any] = {}
        try:
            record = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError) as err:
            log.error("restore bound %s unreadable (%s): restoring nothing newer than step 0", path, err)
            record = {"max_step": 0, "detected_at": -1, "reason": f"unreadable record: {err}"}
        local = int(record["max_step"]) if record else _NO_BOUND
        agreed = self.side("policy").reduce_min(local, op="restore_bound")
        if agreed == _NO_BOUND:
            return None
        return RestoreBound(agreed, int(record.get("detected_at", -1)), str(record.get("reason", "")))

    def barrier(self, what: str) -> None:
        """Collective: every rank has got here (bounded by the policy's timeout)."""
        self.side("policy").all_true(True, op=what)

    def clear_restore_bound(self, trainer: Trainer) -> None:
        """After the suspect steps are gone on every rank (the caller's barrier): forget the bound."""
        RunDir(self.record_dir(trainer)).restore_bound.unlink(missing_ok=True)

    # ------------------------------------------------------------------ report
    def report(self) -> dict[str, Any]:
        bus = self.driver.bus if self.driver is not None else None
        out: dict[str, Any] = bus.report() if bus is not None else {"mapping": self.policy_config.mapping()}
        decision = self.decision
        out.update(
            exit_code=int(self.exit_code),
            stopped_at_step=decision.step if decision else None,
            stop_action=decision.action.value if decision else None,
            corrupt_at_step=self.corrupt.step if self.corrupt else None,
            verified_step=self.corrupt.verified_step if self.corrupt else None,
            emergency_saved=self.emergency_saved,
        )
        if self.driver is not None:
            stats = self.driver.stats
            out["step_path"] = {"steps": stats.steps, "ms_per_step": stats.per_step_ms(), "fields": self.driver.fields}
        if self._rollback is not None:
            out["rollback"] = self._rollback.report()
        return out

    def summary(self) -> str:
        decisions = self.driver.bus.decisions if self.driver is not None else []
        lines = [f"resilience policy: {self.policy_config.mapping()}; {len(decisions)} decision(s)"]
        for d in decisions:
            lines.append(f"  step {d.step}: {d.action.value} <- " + "; ".join(v.detail for v in d.verdicts))
        for r in self._rollback.governor.records if self._rollback is not None else []:
            lines.append(
                f"  rollback at step {r.detected_at} ({r.cause}): bad step {r.bad_step}, restored step {r.target} "
                f"in {r.seconds * 1e3:.1f} ms, {r.steps_lost} step(s) lost, skipped {r.skipped or 'nothing'}"
                + (" -> escalated" if r.escalated else "")
            )
        if self.exit_code is not ExitCode.OK:
            lines.append(f"  exit code {int(self.exit_code)} ({self.exit_code.name})")
        return "\n".join(lines)


def _destroy_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
