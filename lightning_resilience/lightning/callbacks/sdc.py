"""SDCVerification: silent data corruption checks on every training step (guards), at a cadence (dual-run replay of
local gradients, cross-replica reconciliation), with in-place recomputation of a corrupt gradient and a stop with a
verified rollback step when the state itself is corrupt."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_resilience.exit_codes import ExitCode
from lightning_resilience.lightning._metrics import log_host_metrics, logging_step
from lightning_resilience.lightning.coordination import Suite
from lightning_resilience.policy import Action, Decision, Event, Verdict
from lightning_resilience.rundir import RunDir
from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.sdc.monitor import SDCMonitor, SDCStats, StepOutcome
from lightning_resilience.sdc.verdict import Diagnosis, SDCEvent

__all__ = ["VERDICT_FILE", "SDCVerification"]

log = logging.getLogger(__name__)

VERDICT_FILE = RunDir(Path()).sdc_verdict.name


class SDCVerification(Callback):
    """Detect silent data corruption, fix it in place when caught before the optimizer step, otherwise post a
    verdict that the state is corrupt, naming the newest verified step to roll back to.

    Example::

        sdc = SDCVerification(SDCConfig(replay_every_n_steps=100, reconcile_every_n_steps=50, run_dir="runs/17"))
        Trainer(callbacks=[sdc, TieredCheckpoint(tiers)]).fit(model, data)

    A corrupt state goes to the suite's policy (``sdc_mismatch``, by default ``rollback``): the fit stops, the
    process ends with ``ExitCode.SDC`` (never 0, whatever the policy did), and a restore bound in the run directory
    makes the next attempt restore at most the verified step and delete the newer, suspect ones. A
    :class:`~lightning_resilience.lightning.callbacks.TieredCheckpoint` in the same Trainer gets
    ``{"sdc_verified": bool}`` in each snapshot's metadata, and its committed steps are the rollback candidates.
    Replays call ``pl_module.training_step`` on the saved batch (its ``self.log`` calls are muted during a replay);
    automatic optimization without gradient accumulation is required.

    Args:
        config: what to check, how often, and what to do.
    """

    report_section = "sdc_verification"

    def __init__(self, config: SDCConfig | None = None) -> None:
        self.config = config or SDCConfig()
        self.monitor: SDCMonitor | None = None
        self.rollback_step: int | None = None
        """Set when the fit was stopped for corrupt state: the newest committed step verified clean (None with
        ``stopped`` True: no verified checkpoint, start again from scratch)."""
        self.stopped = False
        self.rejected_steps: list[int] = []
        """Committed steps this rank rejected after a verdict (their state was found corrupt or unverifiable)."""
        self._batch_idx = 0
        self._handles: list[Any] = []
        self._suite: Suite | None = None
        self._trainer: Trainer | None = None
        self._logged_events = 0

    def __getstate__(self) -> dict[str, Any]:
        # spawn launchers pickle callbacks: the engine (process group, hooks) is per process and rebuilt in setup
        state = self.__dict__.copy()
        state.update(monitor=None, _handles=[], _trainer=None, _suite=None)
        return state

    @property
    def stats(self) -> SDCStats:
        if self.monitor is None:
            raise RuntimeError("SDCVerification has not been set up by a Trainer yet")
        return self.monitor.stats

    @property
    def events(self) -> list[SDCEvent]:
        return [] if self.monitor is None else list(self.monitor.events)

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.monitor = SDCMonitor(list(pl_module.named_parameters()), [], self.config)
        self.stopped, self.rollback_step = False, None
        self._suite = Suite.of(trainer)
        self._suite.join(trainer, "sdc", self, timeout=self.config.timeout)
        self._suite.add_reporter(self)
        self._suite.count_cost(self.monitor.spent_seconds)
        if self.config.run_dir:
            self._suite.set_record_dir(self.config.run_dir)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self.monitor is not None and self._suite is not None
        if not pl_module.automatic_optimization or trainer.accumulate_grad_batches != 1:
            raise ValueError("SDCVerification replays one optimizer step per batch: use automatic optimization "
                             "with accumulate_grad_batches=1")  # fmt: skip
        self._trainer = trainer
        # collective over the job's ranks, in the order of the callbacks: the same on every rank
        self.monitor.setup(side=self._suite.side("sdc", self.config.timeout))
        optimizers = list(trainer.optimizers)
        self.monitor.optimizers = optimizers
        self.monitor.reconciler.optimizers = optimizers
        wrapped = trainer.strategy.model
        ddp = wrapped if isinstance(wrapped, DistributedDataParallel) else None

        def replay_loss(batch: Any) -> torch.Tensor:
            with _muted_logging(pl_module):
                return _loss_of(pl_module.training_step(batch, self._batch_idx))

        def synced_loss(batch: Any) -> torch.Tensor:
            assert ddp is not None
            with _muted_logging(pl_module):
                # through the DDP forward (so the reducer expects this backward), redirected to training_step
                return _loss_of(trainer.strategy.training_step(batch, self._batch_idx))

        device = pl_module.device
        self.monitor.attach(
            replay_loss,
            ddp=ddp,
            synced_loss_fn=synced_loss if ddp is not None else None,
            to_device=lambda t: t.to(device),
            committed=self._committed_steps,
        )
        if self._suite.store is not None:
            self._suite.store.add_meta_provider(self.monitor.meta)
        driver = self._suite.the_driver()
        driver.add_contributor(self.monitor)  # the late guards travel in each step's agreement
        self.monitor.driven = True
        driver.add_bookkeeper(self)
        self._suite.on_rolled_back(lambda step, _lost: self.monitor.rolled_back(step) if self.monitor else None)
        # runs inside optimizer.step(), so before any on_train_batch_end (a snapshot sees this step's verdict)
        self._handles = [opt.register_step_post_hook(self._after_optimizer_step) for opt in optimizers]

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self.monitor is not None
        self.monitor.verified_steps.add(trainer.global_step)  # the start (fresh or a chosen resume) is trusted
        if trainer.global_step > 0:  # a resume: its first step is replayed (sdc.replay_after_restore)
            self.monitor.restored()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        assert self.monitor is not None
        self._batch_idx = batch_idx
        self.monitor.begin_step(trainer.global_step, batch)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        assert self.monitor is not None
        self.monitor.observe_loss(loss)

    @override
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        assert self.monitor is not None
        if not self.stopped:
            self._respond(trainer, self.monitor.before_optimizer_step())

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.monitor is not None and self._trainer is not None and not self.stopped:
            self._respond(self._trainer, self.monitor.after_optimizer_step())

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self.monitor is not None
        events = self.monitor.events
        if logging_step(trainer) or len(events) > self._logged_events:
            s = self.monitor.stats
            log_host_metrics(
                trainer,
                {
                    "resilience/sdc/detections": sum(s.detections.values()),
                    "resilience/sdc/recomputed": s.recomputed,
                    "resilience/sdc/replays": s.replays,
                    "resilience/sdc/guard_fires": sum(s.guard_fired.values()),
                    "resilience/sdc/verified_step": self.monitor.verified_steps.newest,
                },
            )
        self._logged_events = len(events)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.monitor is not None:
            self.monitor.close()

    # --------------------------------------------------------------- response
    def _respond(self, trainer: Trainer, outcome: StepOutcome) -> None:
        assert self.monitor is not None and self._suite is not None
        if not outcome.needs_rollback:
            return
        # the verdict is the same on every rank (computed from gathered data): so is everything below
        self.rollback_step = self.monitor.rollback_target(self._committed_steps())
        diagnoses = {e.verdict for e in outcome.events}
        # the evidence reaches back to the last clean check: every later step is rejected, on every rank and tier
        self._reject(self.monitor.verified_steps.newest, f"SDC at step {outcome.step}: "
                     f"{', '.join(sorted(d.value for d in diagnoses))}, suspects {outcome.suspects}")  # fmt: skip
        unfixable_device = bool(diagnoses & {Diagnosis.PERSISTENT, Diagnosis.INCONCLUSIVE})
        detail = (
            f"{', '.join(sorted(d.value for d in diagnoses))} at step {outcome.step}, suspects {outcome.suspects}; "
            f"restart from verified step {self.rollback_step}"
        )
        verdict = Verdict(
            Event.SDC_MISMATCH, outcome.step, trainer.global_rank, detail, "sdc", verified_step=self.rollback_step
        )
        # stop_on_suspect: a faulty device stops the job even where the policy would only alert
        at_least = Action.ROLLBACK if self.config.stop_on_suspect and unfixable_device else None
        action = self._suite.post(trainer, verdict, at_least=at_least, agreed=True)
        self._write_verdict(trainer, outcome, stop=action.stops)
        log.error(
            "silent data corruption: %s -> %s (exit code %d at the end of fit)", detail, action.value, ExitCode.SDC
        )
        if action.stops:
            self.stopped = True  # no more checks: the suite stops the fit at this step's end

    def after_step(self, step: int, decision: Decision | None) -> None:
        """The step driver's bookkeeping: a late non-finite verdict that stops the job is recorded in the run
        directory, as an SDC verdict is."""
        if decision is None or decision.event is not Event.NONFINITE or not decision.action.stops or self.stopped:
            return
        assert self.monitor is not None
        self.stopped = True
        self.rollback_step = next((v.verified_step for v in decision.verdicts if v.source == "sdc"), None)
        bad = self.monitor.late_nonfinite_step
        self._reject(bad if bad is not None else step - 1, f"non-finite update at step {bad}, agreed at step {step}")
        if self._trainer is not None:
            late = [e for e in self.monitor.events if e.mechanism == "guard:nonfinite"][-1:]
            self._write_verdict(self._trainer, StepOutcome(step, late, needs_rollback=True), stop=True)

    def _reject(self, newest_good: int, reason: str) -> None:
        store = self._suite.store if self._suite is not None else None
        if store is not None:
            self.rejected_steps = sorted({*self.rejected_steps, *store.reject_after(newest_good, reason)})

    def _committed_steps(self) -> list[int]:
        store = self._suite.store if self._suite is not None else None
        if store is None:
            return []
        steps: set[int] = set()
        for tier, tier_steps in store.committed_steps().items():
            if self.config.rollback_tiers is None or tier in self.config.rollback_tiers:
                steps.update(tier_steps)
        return sorted(steps)

    def _write_verdict(self, trainer: Trainer, outcome: StepOutcome, stop: bool) -> None:
        if self.config.run_dir is None or not trainer.is_global_zero:
            return
        assert self.monitor is not None
        hosts = self.monitor.hosts
        payload = {
            "step": outcome.step,
            "verdicts": sorted({e.verdict.value for e in outcome.events}),
            "suspects": [{"rank": r, "host": hosts[r] if r < len(hosts) else None} for r in outcome.suspects],
            "rollback_step": self.rollback_step,
            "exit_code": int(ExitCode.SDC),
            "stopped": stop,
            "events": [e.to_json() for e in self.monitor.events],
        }
        path = RunDir(Path(self.config.run_dir)).sdc_verdict
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, path)

    # ----------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {} if self.monitor is None else self.monitor.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.monitor is not None:
            self.monitor.load_state_dict(state_dict)

    # ----------------------------------------------------------------- report
    def report(self) -> dict[str, Any]:
        """JSON-able figures for the machine-readable end-of-run report."""
        if self.monitor is None:
            return {"ran": False}
        s = self.monitor.stats
        return {
            "ran": True,
            "steps": s.steps,
            "guard_fired": dict(s.guard_fired),
            "replay_rounds": s.replay_rounds,
            "replays": s.replays,
            "reconcile_rounds": s.reconcile_rounds,
            "detections": dict(s.detections),
            "recomputed": s.recomputed,
            "seconds": {
                "guards": s.guard_seconds,
                "replay": s.replay_seconds,
                "reconcile": s.reconcile_seconds,
                "ddp_fingerprint": s.fingerprint_seconds,
            },
            "suspects": {str(k): v for k, v in self.monitor.suspects.items()},
            "newest_verified_step": self.monitor.verified_steps.newest,
            "rejected_steps": list(self.rejected_steps),
            "stopped": self.stopped,
            "rollback_step": self.rollback_step,
            "events": [e.to_json() for e in self.monitor.events],
        }

    def summary(self) -> str:
        """A short human-readable account of what was checked, found and done."""
        if self.monitor is None:
            return "sdc verification: not run"
        s = self.monitor.stats
        lines = [
            f"sdc verification: {s.steps} steps guarded, {s.replay_rounds} replay rounds ({s.replays} replays), "
            f"{s.reconcile_rounds} reconciliations; detections {dict(s.detections) or 'none'}, "
            f"recomputed in place {s.recomputed}",
        ]
        for e in self.monitor.events:
            lines.append(f"  step {e.step}: {e.verdict.value} by {e.mechanism}, suspects {e.suspects}, {e.action}")
        if self.rejected_steps:
            lines.append(f"  rejected checkpoint steps {self.rejected_steps} in every tier")
        if self.stopped:
            lines.append(f"  stopped: restart from verified step {self.rollback_step}")
        return "\n".join(lines)


def _loss_of(output: Any) -> torch.Tensor:
    loss = output["loss"] if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"SDC replay needs training_step to return a loss tensor, got {type(output).__name__}")
    return loss


@contextlib.contextmanager
def _muted_logging(pl_module: LightningModule) -> Iterator[None]:
    """A replay recomputes training_step: its self.log calls must not count twice."""

    def mute(*args: Any, **kwargs: Any) -> None:
        return None

    pl_module.log, pl_module.log_dict = mute, mute  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict
