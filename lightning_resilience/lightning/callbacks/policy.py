"""ResiliencePolicy: the event -> action mapping of the Trainer's suite, and its section of the report.

Every Trainer with one of our callbacks has one policy: detectors post their verdicts to the suite
(:class:`~lightning_resilience.lightning.coordination.Suite`), whose step driver agrees on them in each step's one
agreement and carries the decision out, every rank alike. Without this callback the mapping is
:class:`PolicyConfig`'s defaults; with it, the mapping is yours (e.g. ``PolicyConfig(straggler="alert")`` never
stops the job for a slow rank).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_resilience.lightning.coordination import Suite
from lightning_resilience.policy import Action, Event, PolicyConfig, Verdict

__all__ = ["ResiliencePolicy"]


class ResiliencePolicy(Callback):
    """Sets what every detector's verdict leads to; every rank takes the same action at the same step.

    Args:
        config: event -> action mapping, and whether the process ends with the decided exit code after ``fit``.
    """

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self._suite: Suite | None = None
        self._trainer: Trainer | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_suite=None, _trainer=None)  # per process, found again in setup
        return state

    @property
    def suite(self) -> Suite | None:
        return self._suite

    @property
    def exit_code(self) -> int:
        """The code the process ends with (0 while nothing stopped the job)."""
        return int(self._suite.exit_code) if self._suite is not None else 0

    @property
    def stopped_at_step(self) -> int | None:
        decision = self._suite.decision if self._suite is not None else None
        return decision.step if decision is not None else None

    @property
    def rollback_step(self) -> int | None:
        corrupt = self._suite.corrupt if self._suite is not None else None
        return corrupt.verified_step if corrupt is not None else None

    def post(self, event: Event, step: int, rank: int, detail: str, *, source: str = "") -> Action:
        """Post a verdict of your own detector: agreed with every rank in the next step's agreement and decided at
        that step's end (one step later), whatever rank posted it."""
        if self._suite is None or self._trainer is None:
            raise RuntimeError("ResiliencePolicy.post before setup: attach the callback to the Trainer")
        return self._suite.post(self._trainer, Verdict(event, step, rank, detail, source))

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        self._suite = Suite.of(trainer)
        self._suite.join(trainer, "policy", self, timeout=timedelta(seconds=self.config.timeout_s))
        self._suite.set_policy(self.config)

    # ----------------------------------------------------------------- report
    def summary(self) -> str:
        return self._suite.summary() if self._suite is not None else "resilience policy: not run"

    def report(self) -> dict[str, Any]:
        return self._suite.report() if self._suite is not None else {"mapping": self.config.mapping()}
