"""ResiliencePolicy: detectors post verdicts here; one collective decision per step boundary, one action.

Our detector callbacks (straggler, SDC, fault tolerance) find this callback on the Trainer and post to its bus
instead of acting on their own; without it each acts on its own configuration. The decision is reduced across
ranks (the most severe action any rank asked for), so every rank acts the same way at the same step.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_resilience.collective import SideGroup
from lightning_resilience.exit_codes import ExitCode
from lightning_resilience.lightning._metrics import log_host_metrics
from lightning_resilience.lightning._trainer_state import dump_trainer_state
from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint
from lightning_resilience.policy import Action, Decision, Event, PolicyBus, PolicyConfig, PostedVerdict

__all__ = ["POLICY_STOP_EXIT_CODE", "ResiliencePolicy", "find_policy"]

log = logging.getLogger(__name__)

AGREEMENT_TIMEOUT = timedelta(minutes=10)
"""Bound on the per-step agreement (a rank that never arrives is a hang: the watchdog ends the job first)."""

POLICY_STOP_EXIT_CODE = int(ExitCode.POLICY_STOP)
"""Exit code after a 'checkpoint_and_stop' decision whose verdicts name no code of their own."""


def find_policy(trainer: Trainer) -> ResiliencePolicy | None:
    """The policy callback attached to ``trainer``, if any (detectors post to it instead of acting alone)."""
    return next((cb for cb in trainer.callbacks if isinstance(cb, ResiliencePolicy)), None)  # type: ignore[attr-defined]


class ResiliencePolicy(Callback):
    """Turns the verdicts of every detector into one action per step, agreed by all ranks.

    Args:
        config: event -> action mapping (e.g. ``PolicyConfig(straggler="alert")`` to never stop for a slow rank).
    """

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.bus: PolicyBus | None = None
        self.exit_code: int | None = None
        self.stopped_at_step: int | None = None
        self.rollback_step: int | None = None
        self._exit_codes: dict[Event, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["bus"] = None  # rebuilt in setup (its lock and collectives belong to one process)
        return state

    # --------------------------------------------------------------- detectors
    def post(self, event: Event, step: int, rank: int, detail: str, *, source: str = "", exit_code: int = 0) -> Action:
        """Record a verdict; returns the action the policy maps it to (taken at the next decision)."""
        if self.bus is None:
            raise RuntimeError("ResiliencePolicy.post before setup: attach the callback to the Trainer")
        self.bus.post(PostedVerdict(event, step, rank, detail, source))
        if exit_code:
            self._exit_codes.setdefault(event, exit_code)
        return self.bus.action_for(event)

    def note_rollback_step(self, step: int | None) -> None:
        """A detector that asks for a rollback says to which step (the newest verified clean)."""
        self.rollback_step = step

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # the per-step agreement runs on host values on a side gloo group (every rank runs setup): it never waits
        # for the device nor interleaves with the training collectives
        group = SideGroup("policy", AGREEMENT_TIMEOUT)

        def reduce_max(value: int) -> int:
            return group.reduce_max(value, op="policy.decide")

        self.bus = PolicyBus(self.config, reduce_max)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self.bus is not None
        decision = self.bus.decide(trainer.global_step)
        if decision is not None:
            self._act(trainer, pl_module, decision)

    def _act(self, trainer: Trainer, pl_module: LightningModule, decision: Decision) -> None:
        events = sorted({v.event.value for v in decision.verdicts})
        details = "; ".join(v.detail for v in decision.verdicts) or "(verdict posted on another rank)"
        message = (
            f"policy at step {decision.step}: {decision.action.value} ({', '.join(events) or 'remote'}: {details})"
        )
        if decision.action in (Action.LOG, Action.ALERT):
            (log.warning if decision.action is Action.ALERT else log.info)(message)
        else:
            log.error(message)
        log_host_metrics(trainer, {"resilience/policy/action_severity": decision.action.severity})
        if decision.action is Action.CHECKPOINT_AND_STOP:
            tiered = next((cb for cb in trainer.callbacks if isinstance(cb, TieredCheckpoint)), None)  # type: ignore[attr-defined]
            if tiered is not None and tiered.manager is not None:
                tiered.manager.flush(trainer.global_step, lambda: dump_trainer_state(trainer))
            self._stop(trainer, decision, POLICY_STOP_EXIT_CODE)
        elif decision.action is Action.ROLLBACK:
            self._stop(trainer, decision, POLICY_STOP_EXIT_CODE)
        # emergency_save_and_exit and dump_and_exit are carried out by the fault-tolerance callback itself (the
        # watchdog thread cannot wait for a step boundary); the decision is recorded for the report

    def _stop(self, trainer: Trainer, decision: Decision, default_code: int) -> None:
        trainer.should_stop = True
        self.stopped_at_step = decision.step
        codes = [self._exit_codes[v.event] for v in decision.verdicts if v.event in self._exit_codes]
        self.exit_code = codes[0] if codes else default_code

    # ----------------------------------------------------------------- report
    def summary(self) -> str:
        if self.bus is None:
            return "resilience policy: not run"
        lines = [f"resilience policy: {self.config.mapping()}; {len(self.bus.decisions)} decision(s)"]
        for d in self.bus.decisions:
            lines.append(f"  step {d.step}: {d.action.value} <- " + "; ".join(v.detail for v in d.verdicts))
        if self.exit_code is not None:
            lines.append(f"  stopped at step {self.stopped_at_step}, exit code {self.exit_code}")
        return "\n".join(lines)

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = self.bus.report() if self.bus is not None else {"mapping": self.config.mapping()}
        out.update(exit_code=self.exit_code, stopped_at_step=self.stopped_at_step, rollback_step=self.rollback_step)
        return out
