"""In-process rollback for one Trainer: the policy's ``rollback_in_process`` decision carried out in the running
process, on every rank alike.

At the step boundary where the ranks decided, every rank (1) agrees on the first bad step (the smallest any rank's
verdict names), (2) agrees on the newest snapshot every rank holds in RAM at or before it, (3) restores it in place
through :class:`~lightning_resilience.lightning.callbacks.TieredCheckpoint` — model, optimizers, schedulers,
precision scaler, loops, callbacks, RNG streams, the train loaders' position — (4) leaves the offending batch out
of its epoch on every rank and writes its sample indices to the quarantine file, and (5) goes on training. Nothing is
read from disk, no process or process group is created. The restored step stays in RAM (a fault that comes back at
once is rolled back again). Past ``policy.rollback.max_rollbacks`` per window the job escalates: the good state is
restored, persisted, and the job stops with a code that says whether a restart can help: ``ExitCode.SDC`` (restart
elsewhere) for an SDC mismatch or a fault that came back at the same step whatever the batch, else
``ExitCode.DIVERGED`` (no restart).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from lightning.pytorch import Trainer

from lightning_resilience.exit_codes import ExitCode
from lightning_resilience.lightning._metrics import log_host_metrics
from lightning_resilience.policy import Action, Decision, Event, Verdict
from lightning_resilience.rollback.config import RollbackConfig
from lightning_resilience.rollback.governor import LrCooldown, RollbackGovernor, RollbackPlan, RollbackRecord
from lightning_resilience.rollback.quarantine import append_quarantine
from lightning_resilience.rundir import RunDir

if TYPE_CHECKING:
    from lightning_resilience.lightning.coordination import Suite

__all__ = ["InProcessRollback"]

log = logging.getLogger(__name__)

_NONE = 2**62


class InProcessRollback:
    """Carries out in-process rollbacks for one Trainer's suite and keeps their record.

    Args:
        config: steps back, skipping, cool-down, the cap per window.
    """

    def __init__(self, config: RollbackConfig) -> None:
        self.config = config
        self.governor = RollbackGovernor(config)
        self.cooldown = LrCooldown(config.lr_cooldown_factor)
        self._cooldown_installed = False

    def run(self, suite: Suite, trainer: Trainer, decision: Decision) -> Decision | None:
        """Collective (every rank calls it at the same step boundary). Returns the stopping decision it escalates to,
        or None when training goes on from the restored step."""
        start = time.perf_counter()
        group = suite.side("rollback")
        mine = [v for v in decision.verdicts if suite.action_for(v.event) is Action.ROLLBACK_IN_PROCESS]
        local = min((_bad_step(v) for v in mine), default=_NONE)
        bad = group.reduce_min(local, op="rollback_bad_step", step=trainer.global_step)
        bad = min(bad, trainer.global_step - 1)  # at the latest, the batch that just ran
        store = suite.store
        held = store.memory_steps() if store is not None else []
        gathered = group.all_gather_object(held, op="rollback_steps", step=trainer.global_step)
        common = set.intersection(*(set(g) for g in gathered)) if gathered else set()
        plan = self.governor.plan(bad, trainer.global_step, common)
        if plan.target is None or store is None:
            return self._stop_unrestored(suite, trainer, decision, plan)
        restored = store.restore_memory(plan.target)  # collective; raises if not loadable everywhere
        # the updates from the bad step on are suspect wherever they were committed: rejected on every rank and tier
        store.reject_after(bad, f"{decision.event.value} at step {bad}, rolled back in the process at step "
                                f"{plan.detected_at}")  # fmt: skip
        # a device fault (SDC mismatch) is not the data's doing: its batch is trained on again
        skip = self.config.skip_batch and not plan.escalate and decision.event is not Event.SDC_MISMATCH
        skip_ahead = bad - plan.target if skip else None
        skipped = store.rollback_to(trainer, restored, skip_ahead)
        suite.rolled_back(plan.target, plan.detected_at - plan.target)
        indices = group.all_gather_object(skipped, op="rollback_quarantine", step=plan.target)
        detail = "; ".join(v.detail for v in mine) or "(verdict posted on another rank)"
        code, why = _escalation(decision.event, plan) if plan.escalate else (ExitCode.OK, "")
        if plan.escalate:
            detail += f"; {plan.reason}: stopping with exit code {int(code)} ({code.name}): {why}"
        record = RollbackRecord(
            cause=decision.event.value,
            bad_step=bad,
            detected_at=plan.detected_at,
            target=plan.target,
            steps_lost=plan.detected_at - plan.target,
            seconds=time.perf_counter() - start,
            skipped=_by_rank(indices) if skip_ahead is not None else {},
            detail=detail,
            escalated=plan.escalate,
        )
        self.governor.record(record)
        self._write_record(suite, trainer, record)
        log_host_metrics(trainer, {"resilience/rollback/count": len(self.governor.records),
                                   "resilience/rollback/seconds": record.seconds})  # fmt: skip
        if plan.escalate:
            log.error("in-process rollback: %s; step %d restored, persisting it and stopping with exit code %d (%s): "
                      "%s", plan.reason, plan.target, code, code.name, why)  # fmt: skip
            return Decision(trainer.global_step, Action.CHECKPOINT_AND_STOP, decision.event, decision.verdicts,
                            code=code)  # fmt: skip
        if self.config.lr_cooldown_steps:
            if not self._cooldown_installed:
                self.cooldown.install(list(trainer.optimizers))
                self._cooldown_installed = True
            self.cooldown.start(self.config.lr_cooldown_steps)
        if trainer.is_global_zero:
            log.warning(
                "in-process rollback for %s at step %d: restored step %d from RAM in %.1f ms, %s",
                decision.event.value, bad, plan.target, record.seconds * 1e3,
                f"skipped the batch of step {bad}" if skip_ahead is not None else "batch kept",
            )  # fmt: skip
        return None

    def _stop_unrestored(self, suite: Suite, trainer: Trainer, decision: Decision, plan: RollbackPlan) -> Decision:
        """No snapshot old enough in RAM on every rank: stop without saving (the state is suspect) with a code that
        asks for a restart, which restores at most the step before the bad one from a persistent tier."""
        bound = max(plan.bad_step - self.config.steps_back, 0)
        log.error("in-process rollback impossible: %s; stopping with exit code %d (%s) for a restart from a persisted "
                  "step <= %d", plan.reason, _RESTART, _RESTART.name, bound)  # fmt: skip
        verdict = Verdict(decision.event, plan.detected_at, trainer.global_rank, plan.reason, "rollback",
                          verified_step=bound, bad_step=plan.bad_step)  # fmt: skip
        suite.mark_corrupt(trainer, verdict)
        if suite.store is not None:
            suite.store.reject_after(plan.bad_step, f"{decision.event.value} at step {plan.bad_step}, not restorable "
                                                    "in the process")  # fmt: skip
        return Decision(trainer.global_step, Action.ROLLBACK, decision.event, decision.verdicts, code=_RESTART)

    def _write_record(self, suite: Suite, trainer: Trainer, record: RollbackRecord) -> None:
        if not trainer.is_global_zero:
            return
        try:
            append_quarantine(
                RunDir(suite.record_dir(trainer)).quarantine(self.config.quarantine_file), record.to_json()
            )
        except OSError as err:
            log.error("could not write the quarantine record: %s", err)

    def close(self) -> None:
        self.cooldown.remove()
        self._cooldown_installed = False

    def report(self) -> dict[str, Any]:
        return self.governor.report()


def _by_rank(gathered: list[Any]) -> dict[str, list[int]]:
    """Rank -> indices of the skipped batch (the first train loader's; every loader's when there are several)."""
    out: dict[str, list[int]] = {}
    for rank, per_loader in enumerate(gathered):
        found = [b for b in per_loader or [] if b is not None]
        flat = [int(i) for b in found for i in (b if isinstance(b, list) else [b])]
        if found:
            out[str(rank)] = flat
    return out


def _bad_step(verdict: Verdict) -> int:
    """The newest state the verdict allows to restore: its bad step (else its step); for an SDC mismatch at most the
    newest verified step (a reconciliation at a cadence finds corruption that may be older than the last step)."""
    bad = verdict.bad_step if verdict.bad_step is not None else verdict.step
    if verdict.event is Event.SDC_MISMATCH:
        bad = min(bad, verdict.verified_step if verdict.verified_step is not None else 0)
    return bad


_RESTART = ExitCode.SDC
"""The code of a stop whose restart can help: the launcher restarts (elsewhere), the restart restores at most the
bound written to the run directory."""


def _escalation(event: Event, plan: RollbackPlan) -> tuple[ExitCode, str]:
    """The exit code past the cap, and why: a restart only where one can help."""
    if event is Event.SDC_MISMATCH:
        return _RESTART, "the replicas disagree: restart without the suspect device"
    if plan.recurs:
        return _RESTART, (
            f"the fault came back at step {plan.bad_step} with other batches: not the data; restart on other hardware"
        )
    return ExitCode.DIVERGED, "the values keep going wrong at different steps: a restart would meet them again"
