"""The FaultTolerance callback in a real single-process Trainer: hang detection wired to Lightning's hooks, a
preemption notice ending in an emergency save and a requeue exit code, a resume that starts calibrated, pickling."""

from __future__ import annotations

import csv
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_resilience import DecidedExit, ExitCode, LocalTier, MemoryTier, TieredCheckpoint
from lightning_resilience.ft.config import FaultToleranceConfig
from lightning_resilience.ft.watchdog import Hang
from lightning_resilience.lightning.callbacks.fault_tolerance import FaultTolerance
from tests.lightning._training import build, trainer

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30.0


def _config(run_dir: Path, **kw: Any) -> FaultToleranceConfig:
    args: dict[str, Any] = dict(
        run_dir=str(run_dir),
        warmup_steps=2,
        min_timeout_s=60.0,
        max_timeout_s=120.0,
        ledger_interval_s=0.0,
        nvrx="off",
        preemption_signals=["SIGUSR1"],
    )
    args.update(kw)
    return FaultToleranceConfig(**args)


class NotifyAt(Callback):
    """A preemption notice (as the signal handler records it) during a given step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            ft = next(c for c in trainer.callbacks if isinstance(c, FaultTolerance))
            assert ft.preemption is not None
            ft.preemption.notify()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StallAt(Callback):
    """Stalls a step on the watchdog's fake clock, then blocks until the watchdog reports it (event-driven)."""

    def __init__(self, step: int, clock: FakeClock, detected: threading.Event) -> None:
        self.step, self.clock, self.detected = step, clock, detected

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.clock.now += 1000.0
            ft = next(c for c in trainer.callbacks if isinstance(c, FaultTolerance))
            assert ft.watchdog is not None
            ft.watchdog.poke()
            assert self.detected.wait(WAIT_S), "the watchdog did not report the stalled step"


def _tiers(root: Path) -> list[Any]:
    return [MemoryTier(every_n_steps=1, keep=2), LocalTier(root / "ckpt", every_n_steps=50, keep=2)]


def test_preemption_notice_saves_the_newest_snapshot_and_the_resume_starts_calibrated(tmp_path: Path) -> None:
    ft = FaultTolerance(_config(tmp_path / "run"))
    model, data = build()
    fit = trainer(12, [ft, TieredCheckpoint(_tiers(tmp_path)), NotifyAt(6)])
    with pytest.raises(DecidedExit) as ended:  # the end of fit ends the process with the requeue code
        fit.fit(model, datamodule=data)
    assert ended.value.code == ExitCode.PREEMPTED == 87
    # one process: the notice during step 7 stops at the boundary right after it
    assert fit.global_step == 7 and ft.preempted_at == 7 and ft.exit_code == ExitCode.PREEMPTED
    assert ft.emergency_saved == 7  # the newest RAM snapshot, although the disk tier's cadence is 50 steps
    assert (tmp_path / "ckpt" / f"step_{7:012d}").is_dir()
    assert ft.calibrator.calibrated("step")
    first_timeout = ft.calibrator.timeout("step")
    assert ft.watchdog is not None and ft.watchdog._thread is None  # joined at teardown

    ft2 = FaultTolerance(_config(tmp_path / "run"))
    resumed_at: dict[str, Any] = {}

    class Probe(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            resumed_at.update(step=trainer.global_step, calibrated=ft2.calibrator.calibrated("step"))
            resumed_at["timeout"] = ft2.calibrator.timeout("step")

    model, data = build()
    fit2 = trainer(12, [ft2, TieredCheckpoint(_tiers(tmp_path)), Probe()])
    fit2.fit(model, datamodule=data)
    assert resumed_at == {"step": 7, "calibrated": True, "timeout": first_timeout}
    assert fit2.global_step == 12 and ft2.exit_code == 0
    report = ft2.report()
    assert [a["end_reason"] for a in report["attempts"]] == ["preempted", "finished"]
    assert report["ettr"]["causes"] == ["preempted"] and report["ettr"]["recomputed_steps"] == 0
    assert "ETTR" in ft2.summary() and "causes preempted" in ft2.summary()


def test_a_stalled_step_is_reported_with_its_section_and_step(tmp_path: Path) -> None:
    detected = threading.Event()
    hangs: list[Hang] = []

    def on_hang(hang: Hang) -> None:
        hangs.append(hang)
        detected.set()

    clock = FakeClock()  # only the stalled step moves it
    ft = FaultTolerance(_config(tmp_path / "run"), on_hang=on_hang, clock=clock)
    model, data = build()
    trainer(6, [ft, StallAt(3, clock, detected)]).fit(model, datamodule=data)
    # warm-up (2 steps) calibrated the step timeout to its floor of 60 s; the stall lasted 1000 s
    assert [(h.section, h.step, h.calibrated, h.timeout_s) for h in hangs] == [("step", 3, True, 60.0)]
    assert hangs[0].stuck_for_s == 1000.0


def test_exception_is_recorded_and_the_watchdog_stopped(tmp_path: Path) -> None:
    from tests.lightning._training import CrashAt

    ft = FaultTolerance(_config(tmp_path / "run"))
    model, data = build()
    with pytest.raises(RuntimeError, match="injected crash"):
        trainer(10, [ft, TieredCheckpoint(_tiers(tmp_path)), CrashAt(4)]).fit(model, datamodule=data)
    assert ft.watchdog is not None and ft.watchdog._thread is None  # no teardown hook runs after an exception
    assert ft.exception is not None and "injected crash at step 4" in ft.exception
    assert ft.ledger is not None and ft.ledger.attempts[-1].end_reason == "exception"
    (note,) = ft.ledger.attempts[-1].faults
    assert note["kind"] == "exception" and note["step"] == 4


def test_callback_pickles_after_setup_without_its_threads(tmp_path: Path) -> None:
    ft = FaultTolerance(_config(tmp_path / "run"))
    model, data = build()
    trainer(3, [ft]).fit(model, datamodule=data)
    clone = pickle.loads(pickle.dumps(ft))
    assert clone.watchdog is None and clone.ledger is None and clone.preemption is None
    assert clone.calibrator.timeouts() == ft.calibrator.timeouts()
    assert clone.state_dict()["calibration"] == ft.state_dict()["calibration"]


def test_metrics_are_logged_under_resilience_ft(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    ft = FaultTolerance(_config(tmp_path / "run"))
    model, data = build()
    fit = Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=CSVLogger(tmp_path / "logs"),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[ft, TieredCheckpoint(_tiers(tmp_path))],
    )
    fit.fit(model, datamodule=data)
    assert fit.logger is not None and fit.logger.log_dir is not None
    fit.logger.save()
    with open(Path(fit.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = {k: v for row in rows for k, v in row.items() if v not in ("", None)}
    for key in ("step_timeout_s", "restart_count", "ettr", "restart_gap_s", "recompute_s", "checkpoint_blocking_s"):
        assert f"resilience/ft/{key}" in logged, sorted(logged)
    assert 0 < float(logged["resilience/ft/ettr"]) <= 1
    assert float(logged["resilience/ft/checkpoint_blocking_s"]) > 0
