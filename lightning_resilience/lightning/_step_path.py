"""The step path in Lightning: the suite's own callback that runs the step driver at Lightning's hooks, and the
driver's actor, which carries a decision out on the Trainer."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_resilience.lightning._metrics import log_host_metrics
from lightning_resilience.policy import Action, Decision
from lightning_resilience.step.driver import Actor

if TYPE_CHECKING:
    from lightning_resilience.lightning.coordination import Suite

__all__ = ["StepPath", "act_for"]

log = logging.getLogger(__name__)


class StepPath(Callback):
    """The suite's own callback: runs the step driver at Lightning's hooks. Added by the first member to join and
    kept the last callback, so that the process ends (``DecidedExit``) after every other callback's ``teardown``."""

    def __init__(self, suite: Suite) -> None:
        self._suite = suite

    @property
    @override
    def state_key(self) -> str:
        return "lightning_resilience.StepPath"

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if callbacks[-1] is not self:  # a new list: Lightning's loop goes on over the one it holds
            trainer.callbacks = [c for c in callbacks if c is not self] + [self]  # type: ignore[attr-defined]

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._suite.train_start(trainer)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._suite.batch_start(trainer)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._suite.batch_end(trainer, pl_module, batch_idx)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._suite.train_end(trainer, pl_module)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._suite.abort()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._suite.fit_end(trainer)


class _Act:
    """The driver's :class:`~lightning_resilience.step.driver.Actor` for one step boundary of one Trainer."""

    def __init__(self, suite: Suite, trainer: Trainer, pl_module: LightningModule) -> None:
        self.suite, self.trainer, self.pl_module = suite, trainer, pl_module

    def rollback(self, decision: Decision) -> Decision | None:
        escalated = self.suite.in_process().run(self.suite, self.trainer, decision)
        log_host_metrics(self.trainer, {"resilience/policy/action_severity": decision.action.severity})
        return escalated

    def note(self, decision: Decision) -> None:
        log_host_metrics(self.trainer, {"resilience/policy/action_severity": decision.action.severity})
        if self.trainer.is_global_zero:
            (log.warning if decision.action is Action.ALERT else log.info)(_describe(decision))

    def stop(self, decision: Decision) -> None:
        suite, trainer = self.suite, self.trainer
        log_host_metrics(trainer, {"resilience/policy/action_severity": decision.action.severity})
        log.error(_describe(decision))
        if decision.action is Action.CHECKPOINT_AND_STOP:
            suite.persist_now(trainer, reason=decision.event.value)
        elif decision.action is Action.EMERGENCY_SAVE_AND_EXIT and suite.store is not None:
            suite.emergency_saved = suite.store.emergency_save(collective=True)  # every rank is here
        # ROLLBACK: nothing is saved (the state is corrupt); the restart restores at most the verified step
        trainer.should_stop = True


def _describe(decision: Decision) -> str:
    details = "; ".join(v.detail for v in decision.verdicts) or "(verdict posted on another rank)"
    code = decision.exit_code
    ending = f"; exit code {int(code)} ({code.name})" if decision.action.stops else ""
    what = f"{decision.action.value} ({decision.event.value}: {details})"
    return f"resilience policy at step {decision.step}: {what}{ending}"


def act_for(suite: Suite, trainer: Trainer, pl_module: LightningModule) -> Actor:
    """The actor of one step boundary."""
    return _Act(suite, trainer, pl_module)
