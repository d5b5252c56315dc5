"""StragglerDetection: time every training step on every rank with the collective waits taken out, find the rank
that slows the job down and its slow component (compute or data), report a job-wide slowdown, and act on it (log,
alert, or checkpoint and stop with a distinct exit code)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_resilience.exit_codes import ExitCode
from lightning_resilience.lightning.coordination import Suite
from lightning_resilience.policy import Action, Decision, Event, Verdict
from lightning_resilience.straggler.config import StragglerConfig
from lightning_resilience.straggler.detector import StragglerDetector
from lightning_resilience.straggler.policy import Escalation
from lightning_resilience.straggler.timing import BACKWARD, FORWARD, OPTIMIZER

__all__ = ["StragglerDetection"]

log = logging.getLogger(__name__)


class StragglerDetection(Callback):
    """Per-rank step timing with the collective waits taken out, cross-rank scores and change-point verdicts, with an
    action ladder.

    The callback times the whole batch (``on_train_batch_start`` to ``on_train_batch_end``: ``step``) and the
    collective waits inside it (``wait``: DDP's gradient sync at the end of backward and its buffer broadcast before
    forward, FSDP's parameter gathers before each module's forward; see
    :mod:`lightning_resilience.straggler.probes`), so that ``compute = step - wait`` is the rank's own work; the wait
    for data (``data``) is the time from the end of one batch (after the exchange of timings) to the next batch
    start. By default ``compute`` and ``data`` are tested, so a verdict names the slow rank *and* its slow
    component under DDP, FSDP or on one device; a job-wide slowdown (every rank slower than its own history) is a
    job verdict. The hooks Lightning calls inside the batch also give ``forward`` (to ``on_before_backward``),
    ``backward`` (to ``on_after_backward``) and ``optimizer`` (``on_before_optimizer_step`` to the batch end); add
    your own with ``with callback.section("x"):`` and list the series to test in ``StragglerConfig.sections``::

        detector = StragglerDetection(StragglerConfig(levels=[
            StragglerLevelConfig(action="alert", slowdown=1.2, persist_steps=5),
            StragglerLevelConfig(action="stop", slowdown=1.5, persist_steps=50)]))
        trainer = Trainer(callbacks=[TieredCheckpoint(tiers=...), detector])
        trainer.fit(model)  # after a 'stop': ends the process with ExitCode.STRAGGLER (restart without the node)

    Every ``gather_every_n_steps`` steps the timings of each step since the last exchange go to rank 0 along the
    tree of the suite's step agreement, off the training thread; rank 0 scores them step by step. A 'stop' level
    posts a straggler verdict to the suite's policy on rank 0, and the next step's agreement stops every rank at the
    same step. With the default mapping (``straggler: checkpoint_and_stop``) the suite persists the current
    step through the Trainer's ``TieredCheckpoint``, if any, stops the fit and ends the process with
    ``ExitCode.STRAGGLER``; ``straggler: alert`` only alerts.

    Metrics go to the trainer's loggers every ``log_every_n_steps`` steps and whenever a decision is taken, from
    values already on the host (no device tensor is made or read for them); ``last_metrics`` holds the latest ones.

    Args:
        config: detection, cadence and ladder settings.
        plot_path: where rank 0 writes a PNG of per-rank compute and data times at the end of fit (needs matplotlib).
        max_logged_ranks: per-rank score metrics are logged for at most this many ranks.
        log_every_n_steps: metrics cadence (Lightning's default cadence).
        clock: host clock for the timings (tests inject a fake one; must be picklable under ddp_spawn).
    """

    report_section = "straggler_detection"

    def __init__(
        self,
        config: StragglerConfig | None = None,
        *,
        plot_path: str | Path | None = None,
        max_logged_ranks: int = 64,
        log_every_n_steps: int = 50,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"straggler.log_every_n_steps must be >= 1, got {log_every_n_steps}")
        self.config = config or StragglerConfig()
        self.plot_path = Path(plot_path) if plot_path is not None else None
        self.max_logged_ranks = max_logged_ranks
        self.log_every_n_steps = log_every_n_steps
        self.clock = clock
        self.detector: StragglerDetector | None = None
        self._suite: Suite | None = None
        self._posted = False
        self._trainer: Trainer | None = None
        self.plot_file: Path | None = None
        self._logged_at: int | None = None
        self.last_metrics: dict[str, float] = {}
        self.parallelism = "none"
        self.spent_s = 0.0
        """The detector's step ends on the training thread this fit (seconds): what the cost budget counts."""
        self._previous: list[dict[str, Any]] = []  # decisions of earlier runs of this job (from a checkpoint)
        self._parts: frozenset[str] = frozenset()
        """The parts of the step the hooks time: only those tested (an untested part would be timed and never sent)."""

    def __getstate__(self) -> dict[str, Any]:
        # spawn launchers pickle callbacks: the detector (process group, profiler) is per process, rebuilt in setup
        state = self.__dict__.copy()
        state["detector"], state["_suite"], state["_trainer"] = None, None, None
        return state

    @property
    def _stop(self) -> Decision | None:
        decision = self._suite.decision if self._suite is not None else None
        return decision if decision is not None and decision.event is Event.STRAGGLER else None

    @property
    def exit_code(self) -> int | None:
        """``ExitCode.STRAGGLER`` once the policy stopped the job for a straggler, else None."""
        return int(ExitCode.STRAGGLER) if self._stop is not None else None

    @property
    def stopped_at_step(self) -> int | None:
        stop = self._stop
        return stop.step if stop is not None else None

    @property
    def checkpointed_at_stop(self) -> bool:
        stop = self._stop
        saved = self._suite is not None and self._suite.store is not None
        return stop is not None and stop.action is Action.CHECKPOINT_AND_STOP and saved

    # ------------------------------------------------------------------ user sections
    def section(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time a named part of the step: ``with callback.section("data_aug"): ...`` (a no-op before fit)."""
        if self.detector is None:
            return contextlib.nullcontext()
        return self.detector.section(name)

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._suite = Suite.of(trainer)
        self._suite.join(trainer, "straggler", self, timeout=self.config.gather_timeout)
        self.spent_s = 0.0
        self._suite.count_cost(lambda: self.spent_s)
        self._suite.add_reporter(self)
        self._posted = False

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self._suite is not None
        channels = self._suite.channels()
        if channels.world_size > 1:  # timings go along the step agreement's tree to rank 0, which decides
            self.detector = StragglerDetector.with_tree(self.config, channels.agreement, clock=self.clock)
        else:
            self.detector = StragglerDetector(self.config, clock=self.clock)
        self._parts = frozenset(self.detector.sections) & {FORWARD, BACKWARD, OPTIMIZER}
        driver = self._suite.the_driver()
        driver.add_finisher(self)
        driver.add_bookkeeper(self)
        self._trainer = trainer
        # the strategy has wrapped the model by now (DDP, FSDP): probe its collective waits
        self.parallelism = self.detector.attach(trainer.strategy.model or pl_module)
        if channels.world_size > 1 and self.detector.rank == 0:
            self.detector.start_scorer()  # rank 0 scores the exchanges: its scorer starts before the first step
        auto = self.config.sections is None
        if auto and trainer.world_size > 1 and self.parallelism == "none" and trainer.is_global_zero:
            log.warning(
                "straggler: the collective waits of %s are not measured, so 'compute' includes them and the slow "
                "rank may not stand out; name sections without collectives in straggler.sections",
                type(trainer.strategy).__name__,
            )

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.detector is not None:
            self.detector.timer.reset_data_wait()  # the dataloader restarts: not a data stall

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.detector is not None:
            self.detector.timer.reset_data_wait()  # validation time is not a wait for training data

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.detector is None:
            return
        self.detector.start_step()
        if FORWARD in self._parts:
            self.detector.begin(FORWARD)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        if self.detector is not None:
            self._move(FORWARD, BACKWARD)
            self.detector.arm_backward(loss)

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.detector is not None:
            self.detector.backward_done()
            self._move(BACKWARD, None)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.detector is not None and OPTIMIZER in self._parts:
            self.detector.begin(OPTIMIZER)

    def _move(self, ended: str, begun: str | None) -> None:
        """Close a tested part of the step and open the next one (untested parts are not timed)."""
        assert self.detector is not None
        if ended in self._parts:
            self.detector.end(ended)
        if begun in self._parts:
            self.detector.begin(begun)

    def finish_step(self, step: int) -> None:
        """The step driver's first phase: the step's timings close; an exchange is issued or taken (rank 0 scores
        every rank's timings and posts a 'stop' to the policy, which the next step's agreement carries to all)."""
        detector, trainer = self.detector, self._trainer
        if detector is None or self._suite is None or trainer is None:
            return
        if FORWARD in self._parts:  # manual optimization calls none of the hooks in between: the batch is all forward
            detector.end(FORWARD)
        started = time.perf_counter()
        decisions = detector.end_step(step)
        self.spent_s += time.perf_counter() - started  # the detector's step end: what the cost budget counts
        if detector.scoring and not decisions:
            # the next exchange is being scored (a scoring thread updates the scores and the ladder as it goes): read
            # them once it is done. Decisions just taken are logged and acted on now: a scorer that is always an
            # exchange behind (a loaded machine, thousands of ranks) would otherwise never post its stop
            return
        self._maybe_log_metrics(trainer, decisions)
        if detector.should_stop and not self._posted:
            assert detector.stop_decision is not None
            # one policy decides for every detector (its mapping may only alert)
            found = detector.stop_decision.verdict
            detail = f"rank {found.rank} ({found.node}) {found.slowdown:.2f}x slower in '{found.section}'"
            verdict = Verdict(Event.STRAGGLER, trainer.global_step, trainer.global_rank, detail, "straggler")
            self._suite.post(trainer, verdict)
            self._posted = True

    def after_step(self, step: int, decision: Decision | None) -> None:
        """The step driver's last phase: from here on the rank waits for its next batch (the suite's own work at the
        step's end is not counted as a data wait)."""
        if self.detector is not None:
            self.detector.timer.mark_idle()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close()  # idempotent: also after the suite's DecidedExit

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.plot_path is not None and self.detector is not None and trainer.is_global_zero:
            self.plot_file = self.detector.plot(self.plot_path)
        self._close()
        self._trainer = None

    def _close(self) -> None:
        if self.detector is not None:
            self.detector.close()

    def _maybe_log_metrics(self, trainer: Trainer, decisions: list[Escalation]) -> None:
        """At the trainer's logging cadence (or when something was decided), the latest scores to its loggers."""
        detector = self.detector
        assert detector is not None
        step = trainer.global_step
        due = self._logged_at is None or step - self._logged_at >= self.log_every_n_steps
        if not (detector.gathers and (due or decisions)):
            return
        self._logged_at = step
        metrics: dict[str, float] = {}
        board = detector.scoreboard
        for i, name in enumerate(detector.sections):
            # one row of N scores: read in NumPy, never N Python floats on the training thread
            row = board.relative[i] if detector.mode == "relative" else board.individual[i]
            finite = np.isfinite(row)
            if not finite.any():
                continue
            worst_rank = int(np.argmax(np.where(finite, row, -np.inf)))
            metrics[f"resilience/straggler/{name}/slowest_rank"] = float(worst_rank)
            metrics[f"resilience/straggler/{name}/max_score"] = float(row[worst_rank])
            for r in np.flatnonzero(finite[: self.max_logged_ranks]):
                metrics[f"resilience/straggler/{name}/score/rank_{r}"] = float(row[r])
        if math.isfinite(detector.scoreboard.job_last):
            metrics["resilience/straggler/job/slowdown"] = detector.scoreboard.job_last
        metrics["resilience/straggler/verdicts"] = float(len(detector.verdicts))
        metrics["resilience/straggler/noise_level"] = float(len(detector.noise_level))
        metrics["resilience/straggler/active"] = float(len(detector.active))
        metrics["resilience/straggler/alerts"] = float(sum(d.action is Action.ALERT for d in detector.decisions))
        metrics["resilience/straggler/new_decisions"] = float(len(decisions))
        self.last_metrics = metrics
        # host floats straight to the loggers (rank-zero only): no device tensor per value, no sync
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    # ------------------------------------------------------------------ state and report
    @override
    def state_dict(self) -> dict[str, Any]:
        # taken with every snapshot: the newest only, however many decisions a long run took
        decisions = [d.to_dict() for d in self.detector.decisions[-100:]] if self.detector is not None else []
        return {"decisions": (self._previous + decisions)[-100:]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._previous = list(state_dict.get("decisions", []))

    def summary(self) -> str:
        """A compact table of the slowest ranks and the decisions taken, for the end-of-run report."""
        if self.detector is None:
            return "straggler detection: not run"
        lines = [self.detector.summary()]
        if self.exit_code is not None:
            lines.append(
                f"  stopped at step {self.stopped_at_step} with exit code {self.exit_code} "
                f"({'checkpointed' if self.checkpointed_at_stop else 'no checkpoint'})"
            )
        if self._previous:
            lines.append(f"  earlier runs of this job took {len(self._previous)} action(s)")
        if self.plot_file is not None:
            lines.append(f"  plot: {self.plot_file}")
        return "\n".join(lines)

    def report(self) -> dict[str, Any]:
        """JSON-able figures for the machine-readable report."""
        out: dict[str, Any] = self.detector.report() if self.detector is not None else {"run": False}
        out.update(
            {
                "exit_code": self.exit_code,
                "stopped_at_step": self.stopped_at_step,
                "checkpointed_at_stop": self.checkpointed_at_stop,
                "previous_decisions": list(self._previous),
                "plot": str(self.plot_file) if self.plot_file is not None else None,
            }
        )
        return out
