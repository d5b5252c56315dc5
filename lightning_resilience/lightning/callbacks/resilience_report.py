"""ResilienceReportCallback: at the end of ``fit`` (or when it raises), one report of every resilience component."""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_resilience.exit_codes import DecidedExit
from lightning_resilience.lightning.coordination import Reporting, Suite
from lightning_resilience.rundir import RunDir

if TYPE_CHECKING:
    from lightning_resilience.report import ResilienceReport

__all__ = ["ResilienceReportCallback"]

log = logging.getLogger(__name__)

_STEP_CAP = 100_000  # step intervals kept for the median (a long run keeps its newest)


class ResilienceReportCallback(Callback):
    """Collect the figures of every resilience callback at the end of ``fit`` into ``resilience_report.json``.

    On global rank 0, when ``fit`` ends or raises, every member of the Trainer's suite contributes a section (its
    ``report_section``) and its ``summary()``; the suite adds its policy's decisions and exit code
    (``resilience_policy``) and :class:`TieredCheckpoint` the ``checkpoint`` section from its engine's counters.
    This callback adds a ``run`` section (median optimizer step time with checkpoint blocking taken out, world
    size, how fit ended). The report goes to ``<run_dir>/resilience_report.json`` in the schema that
    ``lightning-resilience simulate --from-run <run_dir>`` reads; the table is printed and PNGs are drawn when
    matplotlib is installed. It collects at ``on_fit_end``, after every other callback's ``on_train_end``. When
    ``fit`` raises and torchrun (or ``lightning-resilience launch``) has restarts left, the pictures are left to the
    attempt that ends the job: drawing them would delay the restart by about a second (``lightning-resilience
    report RUN_DIR`` draws them at any time).

    Example::

        Trainer(callbacks=[FaultTolerance(cfg), TieredCheckpoint(tiers), ResilienceReportCallback("runs/demo")])

    Args:
        run_dir: where the report goes; default ``<trainer.default_root_dir>/resilience``.
        print_table: print the rich table on rank 0.
        plots: write PNGs next to the report (skipped without matplotlib).
        clock: monotonic seconds, injectable for tests.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        print_table: bool = True,
        plots: bool = True,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.print_table = print_table
        self.plots = plots
        self._clock = clock
        self.last_report: ResilienceReport | None = None
        self.path: Path | None = None
        self.plot_files: list[Path] = []
        self._step_seconds: list[float] = []
        self._timeline: list[tuple[int, float]] = []
        self._mark: tuple[int, float, float, int] | None = None  # step, time, blocking seconds, captures
        self._written = False
        self._window: list[tuple[float, float]] = []  # (step seconds, blocked seconds) since the last logged step
        self._suite: Suite | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_suite"] = None  # per process, found again in setup
        return state

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.last_report, self.path, self.plot_files = None, None, []
        self._step_seconds, self._timeline, self._mark, self._written = [], [], None, False
        self._window = []
        self._suite = Suite.of(trainer)
        self._suite.join(trainer, "report", self)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self._mark is not None and self._mark[0] == step:
            return  # the next micro-batch of the same optimizer step
        now = self._clock()
        blocking, captures = self._checkpoint_counters()
        if self._mark is not None:
            _, prev_t, prev_blocking, prev_captures = self._mark
            blocked = max(blocking - prev_blocking, 0.0)
            # the interval from one step's start to the next, less the time checkpointing held the loop
            self._step_seconds.append(max(now - prev_t - blocked, 0.0))
            if len(self._step_seconds) > _STEP_CAP:
                del self._step_seconds[: _STEP_CAP // 10]
            if captures > prev_captures:
                self._timeline.append((step, blocked))
            self._window.append((self._step_seconds[-1], blocked))
            self._log_window(trainer)
        self._mark = (step, now, blocking, captures)

    def _log_window(self, trainer: Trainer) -> None:
        """At the logging cadence (``log_every_n_steps``), the step time and the share checkpointing blocked over
        the steps since the last log: host clock readings only, never a device tensor."""
        every = int(getattr(trainer, "log_every_n_steps", 0) or 0)
        if not trainer.loggers or every <= 0 or trainer.global_step % every != 0 or not self._window:
            return
        steps = [s for s, _ in self._window]
        blocked = sum(b for _, b in self._window)
        _log_host_metrics(
            trainer,
            {
                "resilience/report/step_time_s": statistics.median(steps),
                "resilience/report/checkpoint_blocking_share": blocked / max(sum(steps) + blocked, 1e-12),
            },
        )
        self._window = []

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        status = "finished"
        if self._suite is not None and self._suite.exit_code:
            status = f"stopped: exit code {int(self._suite.exit_code)} ({self._suite.exit_code.name})"
        self._finish(trainer, status)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, DecidedExit):
            return  # written at on_fit_end
        try:
            status = f"exception: {type(exception).__name__}: {exception}"[:500]
            self._finish(trainer, status, plots=self.plots and not _restart_follows())
        except Exception as err:  # the training exception is what the user must see
            log.error("could not write the resilience report: %s", err)

    def _checkpoint_counters(self) -> tuple[float, int]:
        """Seconds checkpointing has blocked the loop so far, and snapshots taken."""
        store = self._suite.store if self._suite is not None else None
        if store is None:
            return 0.0, 0
        return store.stats.capture_seconds, store.stats.captures

    # ------------------------------------------------------------------ report
    def _finish(self, trainer: Trainer, status: str, plots: bool | None = None) -> None:
        if self._written or not trainer.is_global_zero:
            return
        self._written = True
        self.last_report = self.collect(trainer, status)
        run_dir = self.run_dir or RunDir.resolve(None, trainer.default_root_dir).root
        console = None
        if self.print_table:
            import sys

            from rich.console import Console

            # a log file (not a terminal) gets lines wide enough for the attempts table
            console = Console(width=None if sys.stdout.isatty() else 140)
        from lightning_resilience.report import write_report  # imported when needed: not on a restart's path

        files = write_report(
            self.last_report,
            run_dir,
            plots=self.plots if plots is None else plots,
            console=console,
            current_attempt="finished" if status == "finished" else None,
        )
        self.path, self.plot_files = files.json, files.pictures
        log.info("%s", files.describe())
        if trainer.loggers:
            _log_host_metrics(trainer, _job_metrics(self.last_report))

    def collect(self, trainer: Trainer, status: str = "running") -> ResilienceReport:
        """Assemble the report from the callbacks on ``trainer`` now (any rank; nothing written)."""
        from lightning_resilience.report import assemble  # imported when needed: not on a restart's path

        sections: dict[str, dict[str, Any]] = {}
        summaries: dict[str, str] = {}
        suite = self._suite or Suite.of(trainer)
        if suite.store is not None:
            sections["checkpoint"] = suite.store.report_section(blocking_timeline=self._timeline)
            summaries["checkpoint"] = suite.store.summary()
        reporters: list[Reporting] = [*suite.reporters, suite]
        for member in reporters:
            name = member.report_section
            try:
                sections[name] = dict(member.report())
            except Exception as err:  # one component's broken report must not lose the others
                sections[name] = {"error": f"{type(err).__name__}: {err}"}
            try:
                summaries[name] = str(member.summary())
            except Exception as err:
                summaries[name] = f"summary failed: {type(err).__name__}: {err}"
        median = statistics.median(self._step_seconds) if self._step_seconds else None
        sections["run"] = {
            "status": status,
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "devices_per_node": trainer.num_devices,
            "steps_timed": len(self._step_seconds),
            "step_seconds_median": median,
            "step_seconds_mean": statistics.fmean(self._step_seconds) if self._step_seconds else None,
        }
        return assemble(
            sections,
            summaries=summaries,
            step_seconds=median,
            gpus=trainer.world_size,
            gpus_per_node=trainer.num_devices,
        )


def _restart_follows() -> bool:
    """This job's launcher has restarts left after this attempt (torchrun's per-attempt variables say so)."""
    try:
        return int(os.environ["TORCHELASTIC_MAX_RESTARTS"]) > int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    except (KeyError, ValueError):
        return False


def _log_host_metrics(trainer: Trainer, metrics: dict[str, float]) -> None:
    """Host numbers straight to the Trainer's loggers at the current step (no ``self.log``: it would make a device
    tensor of every float and read it back)."""
    for logger in trainer.loggers:
        logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=trainer.global_step)


def _job_metrics(report: ResilienceReport) -> dict[str, float]:
    """The whole job's goodput figures, logged once when the report is written."""
    if report.timeline is None:
        return {}
    ettr = report.timeline.get("ettr") or {}
    out = {
        f"resilience/report/{key}": float(ettr[key])
        for key in ("ettr", "wall_s", "productive_s", "restart_gap_s", "recompute_s", "recomputed_steps", "restarts")
        if isinstance(ettr.get(key), int | float)
    }
    out["resilience/report/faults"] = float(sum(a.get("outcome") == "fault" for a in report.attempts))
    return out
