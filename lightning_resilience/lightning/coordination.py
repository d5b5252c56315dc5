"""The suite of one Trainer: how its resilience callbacks find each other, post verdicts, and act once.

Every callback of the suite attaches to ``Suite.of(trainer)`` in its ``setup``, by role (checkpoint, fault
tolerance, straggler, SDC, policy, report), so the others reach it through a typed reference instead of scanning
``trainer.callbacks``. Detectors post :class:`~lightning_resilience.policy.Verdict` s; when the last member (in
the Trainer's callback order) has finished its ``on_train_batch_end``, the suite takes one collective decision
and carries it out — checkpoint and stop, emergency save, stop for a rollback — in one place. The order of the
callbacks in the list does not matter.

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
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_resilience.collective import SideGroup
from lightning_resilience.exit_codes import DecidedExit, ExitCode
from lightning_resilience.ft.ettr import failure_history
from lightning_resilience.lightning._metrics import log_host_metrics
from lightning_resilience.lightning.rollback import InProcessRollback
from lightning_resilience.policy import Action, Decision, Event, PolicyBus, PolicyConfig, Verdict

if TYPE_CHECKING:
    from lightning_resilience.lightning.callbacks.fault_tolerance import FaultTolerance
    from lightning_resilience.lightning.callbacks.policy import ResiliencePolicy
    from lightning_resilience.lightning.callbacks.sdc import SDCVerification
    from lightning_resilience.lightning.callbacks.straggler import StragglerDetection
    from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint

__all__ = ["RESTORE_BOUND_FILE", "Reporting", "RestoreBound", "Suite"]

log = logging.getLogger(__name__)

RESTORE_BOUND_FILE = "restore_bound.json"
"""Written to the run directory when the state was found corrupt: the next attempt restores at most its step."""

_NO_BOUND = 2**62


class Reporting(Protocol):
    """A member that contributes a section to the end-of-run report."""

    report_section: str

    def report(self) -> dict[str, Any]: ...

    def summary(self) -> str: ...


@dataclass(frozen=True)
class RestoreBound:
    """The newest step a restart may restore, and why (a corrupt state found at ``detected_at``)."""

    max_step: int
    detected_at: int
    reason: str


class Suite:
    """The resilience callbacks attached to one Trainer, its policy bus, and the decision they led to."""

    _registry: ClassVar[weakref.WeakKeyDictionary[Trainer, Suite]] = weakref.WeakKeyDictionary()
    report_section = "resilience_policy"

    def __init__(self) -> None:
        self.checkpoint: TieredCheckpoint | None = None
        self.fault_tolerance: FaultTolerance | None = None
        self.straggler: StragglerDetection | None = None
        self.sdc: SDCVerification | None = None
        self.policy: ResiliencePolicy | None = None
        self.reporters: list[Reporting] = []
        self._members: list[Callback] = []
        self._order: list[Callback] | None = None
        self._bus: PolicyBus | None = None
        self._group: SideGroup | None = None
        self.decision: Decision | None = None
        """The decision that stopped the job (the first one that did), or None."""
        self.corrupt: Verdict | None = None
        """The first verdict that found the training state corrupt in this fit, or None."""
        self.emergency_saved: int | None = None
        self.rollback_pending = False
        """An agreed verdict (SDC's, posted on every rank) asked for an in-process rollback at this step: the snapshot
        of this step is not taken, it would hold the suspect state."""
        self._rollback: InProcessRollback | None = None
        self._fit_over = False

    @classmethod
    def of(cls, trainer: Trainer) -> Suite:
        """The suite of ``trainer`` (created on first use)."""
        suite = cls._registry.get(trainer)
        if suite is None:
            suite = cls._registry[trainer] = cls()
        return suite

    # ------------------------------------------------------------------ membership
    def _join(self, member: Callback, reporting: Reporting | None) -> None:
        if member not in self._members:
            self._members.append(member)
            self._order = None
        if reporting is not None and reporting not in self.reporters:
            self.reporters.append(reporting)
        if self._fit_over:  # the Trainer fits again: a new attempt's decisions
            self._fit_over = False
            self._bus, self.decision, self.corrupt, self.emergency_saved = None, None, None, None
            if self._rollback is not None:
                self._rollback.close()
            self._rollback, self.rollback_pending = None, False

    def attach_checkpoint(self, member: TieredCheckpoint) -> None:
        self._claim("checkpoint", self.checkpoint, member)
        self.checkpoint = member
        self._join(member, None)

    def attach_fault_tolerance(self, member: FaultTolerance) -> None:
        self._claim("fault_tolerance", self.fault_tolerance, member)
        self.fault_tolerance = member
        self._join(member, member)

    def attach_straggler(self, member: StragglerDetection) -> None:
        self._claim("straggler", self.straggler, member)
        self.straggler = member
        self._join(member, member)

    def attach_sdc(self, member: SDCVerification) -> None:
        self._claim("sdc", self.sdc, member)
        self.sdc = member
        self._join(member, member)

    def attach_policy(self, member: ResiliencePolicy) -> None:
        self._claim("policy", self.policy, member)
        self.policy = member
        self._bus = None  # rebuilt with this member's mapping
        self._join(member, None)  # the suite reports the policy's decisions itself

    def attach_report(self, member: Callback) -> None:
        self._join(member, None)

    def add_reporter(self, reporting: Reporting) -> None:
        """A component of your own contributes a section to the end-of-run report (call it from ``setup``)."""
        if reporting not in self.reporters:
            self.reporters.append(reporting)

    @staticmethod
    def _claim(role: str, current: Callback | None, member: Callback) -> None:
        if current is not None and current is not member:
            raise ValueError(
                f"the Trainer has two {role} callbacks ({type(current).__name__} and {type(member).__name__}): "
                "keep one (the suite enabled from the environment adds only what the Trainer lacks)"
            )

    # ------------------------------------------------------------------ policy
    @property
    def policy_config(self) -> PolicyConfig:
        return self.policy.config if self.policy is not None else PolicyConfig()

    def action_for(self, event: Event) -> Action:
        return Action(self.policy_config.action_for(event.value))

    def side_group(self) -> SideGroup:
        """The policy's side gloo group; made at its first use, which every rank reaches at the same point (the
        restore bound at fit start, or the first decision), after every member attached."""
        if self._group is None:
            self._group = SideGroup("policy", timedelta(seconds=self.policy_config.timeout_s))
        return self._group

    def bus(self, trainer: Trainer) -> PolicyBus:
        if self._bus is None:
            group = self.side_group()

            def reduce_max(value: int) -> int:
                return group.reduce_max(value, op="decide", step=trainer.global_step)

            self._bus = PolicyBus(self.policy_config, reduce_max)
        return self._bus

    def failure_history(self) -> tuple[float, int] | None:
        """The run's wall-clock seconds so far and the attempts that ended in a fault, from the fault-tolerance
        ledger (global rank 0 keeps it; None elsewhere, or without fault tolerance)."""
        ledger = self.fault_tolerance.ledger if self.fault_tolerance is not None else None
        return failure_history(ledger.attempts) if ledger is not None else None

    def barrier(self, what: str) -> None:
        """Collective: every rank has got here (bounded by the policy's timeout)."""
        self.side_group().all_true(True, op=what)

    def post(self, trainer: Trainer, verdict: Verdict, *, at_least: Action | None = None) -> Action:
        """Record a detector's verdict (decided at this step's end); returns the action it will lead to.

        ``at_least`` raises the mapped action (e.g. SDC's ``stop_on_suspect``: never less than a rollback).
        """
        action = self.bus(trainer).post(verdict, at_least=at_least)
        if action is Action.ROLLBACK_IN_PROCESS:
            # SDC's verdicts are agreed (every rank posts them): only then may the snapshot be skipped, a persist due
            # at this step is an agreement every rank must join
            self.rollback_pending = self.rollback_pending or verdict.source == "sdc"
        elif verdict.event in (Event.SDC_MISMATCH, Event.NONFINITE):
            self.mark_corrupt(trainer, verdict)
        return action

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

    # ------------------------------------------------------------------ step end
    def _ordered(self, trainer: Trainer) -> list[Callback]:
        if self._order is None:
            position = {id(cb): i for i, cb in enumerate(trainer.callbacks)}  # type: ignore[attr-defined]
            self._order = sorted(self._members, key=lambda m: position.get(id(m), len(position)))
        return self._order

    def step_end(self, member: Callback, trainer: Trainer, pl_module: LightningModule) -> None:
        """Every member calls this at the end of its ``on_train_batch_end``; the last one decides for all."""
        order = self._ordered(trainer)
        if not order or member is not order[-1]:
            return
        decision = self.bus(trainer).decide(trainer.global_step)
        self.rollback_pending = False
        if decision is not None:
            self._act(trainer, pl_module, decision)

    def _act(self, trainer: Trainer, pl_module: LightningModule, decision: Decision) -> None:
        if decision.action is Action.ROLLBACK_IN_PROCESS and self.decision is None:
            escalated = self.in_process().run(self, trainer, decision)
            log_host_metrics(trainer, {"resilience/policy/action_severity": decision.action.severity})
            if escalated is None:
                return
            decision = escalated
        details = "; ".join(v.detail for v in decision.verdicts) or "(verdict posted on another rank)"
        message = (
            f"resilience policy at step {decision.step}: {decision.action.value} ({decision.event.value}: {details})"
        )
        log_host_metrics(trainer, {"resilience/policy/action_severity": decision.action.severity})
        if not decision.action.stops:
            if trainer.is_global_zero:
                (log.warning if decision.action is Action.ALERT else log.info)(message)
            return
        if self.decision is not None:
            return  # already stopping: the first decision holds
        log.error(message)
        self.decision = decision
        if decision.action is Action.CHECKPOINT_AND_STOP:
            self.persist_now(trainer, reason=decision.event.value)
        elif decision.action is Action.EMERGENCY_SAVE_AND_EXIT and self.checkpoint is not None:
            self.emergency_saved = self.checkpoint.emergency_save(collective=True)  # every rank is here
        # ROLLBACK: nothing is saved (the state is corrupt); the restart restores at most the verified step
        trainer.should_stop = True

    def persist_now(self, trainer: Trainer, *, reason: str) -> bool:
        """Collective: persist the current step to every persistent tier and wait (every rank at one boundary)."""
        if self.checkpoint is None or self.checkpoint.manager is None:
            if trainer.is_global_zero:
                log.warning("resilience: stopping without a checkpoint (no TieredCheckpoint in the Trainer)")
            return False
        self.checkpoint.persist_now(trainer, {"reason": reason})
        return True

    # ------------------------------------------------------------------ exit
    @property
    def exit_code(self) -> ExitCode:
        """The code the process should end with: the stopping decision's, SDC for a corrupt state, else OK."""
        if self.decision is not None:
            return self.decision.exit_code
        if self.corrupt is not None:
            return ExitCode.SDC
        return ExitCode.OK

    def fit_end(self, member: Callback, trainer: Trainer) -> None:
        """Every member calls this at the end of its ``teardown``; the last one ends the process if decided."""
        order = self._ordered(trainer)
        if not order or member is not order[-1] or self._fit_over:
            return
        self._fit_over = True
        code = self.exit_code
        if code is ExitCode.OK or not self.policy_config.exit_after_fit:
            return
        cause = self.decision or self.corrupt
        reason = (
            f"{self.decision.action.value} for {self.decision.event.value} at step {self.decision.step}"
            if self.decision is not None
            else f"corrupt state found at step {cause.step if cause else '?'}"
        )
        rank_zero_info(f"lightning_resilience: ending the process with exit code {int(code)} ({code.name}): {reason}")
        # the process group goes before interpreter exit: left to finalisation, gloo's threads can abort the process
        # (SIGABRT) and the launcher would see 134 instead of the decided code
        atexit.register(_destroy_process_group)
        raise DecidedExit(code, reason)

    # ------------------------------------------------------------------ restore bound
    def record_dir(self, trainer: Trainer) -> Path:
        """Where the suite keeps records that outlive an attempt: SDC's run_dir, else <default_root_dir>/resilience."""
        if self.sdc is not None and self.sdc.config.run_dir:
            return Path(self.sdc.config.run_dir)
        return Path(trainer.default_root_dir) / "resilience"

    def _write_restore_bound(self, trainer: Trainer, verdict: Verdict) -> None:
        # every rank writes the same record: the run directory may be node-local
        path = self.record_dir(trainer) / RESTORE_BOUND_FILE
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
        path = self.record_dir(trainer) / RESTORE_BOUND_FILE
        record: dict[str, Any] = {}
        try:
            record = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError) as err:
            log.error("restore bound %s unreadable (%s): restoring nothing newer than step 0", path, err)
            record = {"max_step": 0, "detected_at": -1, "reason": f"unreadable record: {err}"}
        local = int(record["max_step"]) if record else _NO_BOUND
        agreed = self.side_group().reduce_min(local, op="restore_bound")
        if agreed == _NO_BOUND:
            return None
        return RestoreBound(agreed, int(record.get("detected_at", -1)), str(record.get("reason", "")))

    def clear_restore_bound(self, trainer: Trainer) -> None:
        """After the suspect steps are gone on every rank (the caller's barrier): forget the bound."""
        (self.record_dir(trainer) / RESTORE_BOUND_FILE).unlink(missing_ok=True)

    # ------------------------------------------------------------------ report
    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = self._bus.report() if self._bus is not None else {"mapping": self.policy_config.mapping()}
        out.update(
            exit_code=int(self.exit_code),
            stopped_at_step=self.decision.step if self.decision else None,
            stop_action=self.decision.action.value if self.decision else None,
            corrupt_at_step=self.corrupt.step if self.corrupt else None,
            verified_step=self.corrupt.verified_step if self.corrupt else None,
            emergency_saved=self.emergency_saved,
        )
        if self._rollback is not None:
            out["rollback"] = self._rollback.report()
        return out

    def summary(self) -> str:
        decisions = self._bus.decisions if self._bus is not None else []
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
