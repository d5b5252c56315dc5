"""Tiers left to the cost budget in a real Trainer: the cadences and why, at fit start, in the report and in the
ledger; the run's failure history reaches the MTBF they assume."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

from lightning_resilience.checkpoint.cadence import BUDGET
from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.ft.config import FaultToleranceConfig
from lightning_resilience.ft.ettr import LEDGER_FILE
from lightning_resilience.lightning.callbacks.fault_tolerance import FaultTolerance
from lightning_resilience.lightning.callbacks.resilience_report import ResilienceReportCallback
from lightning_resilience.lightning.callbacks.sdc import SDCVerification
from lightning_resilience.lightning.callbacks.straggler import StragglerDetection
from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint
from lightning_resilience.lightning.coordination import Suite
from lightning_resilience.report import REPORT_NAME
from lightning_resilience.sdc.config import SDCConfig
from tests.lightning._training import CrashAt, build, trainer

pytestmark = pytest.mark.timeout(120)


def _fit(run: Path, steps: int, *extra: object) -> TieredCheckpoint:
    return _fit_trainer(run, steps, *extra)[0]


def _fit_trainer(run: Path, steps: int, *extra: object) -> tuple[TieredCheckpoint, Trainer]:
    ckpt = TieredCheckpoint(
        [MemoryTier(every_n_steps=BUDGET, keep=2), LocalTier(run / "ckpt", every_n_steps=BUDGET, keep=2)],
        config=CheckpointConfig(cadence_review_steps=5),
    )
    ft = FaultTolerance(FaultToleranceConfig(run_dir=str(run), ledger_interval_s=0.0, nvrx="off"))
    report = ResilienceReportCallback(run, print_table=False, plots=False)
    model, data = build()
    fitted = trainer(steps, [ft, ckpt, report, *extra])  # type: ignore[list-item]
    fitted.fit(model, datamodule=data)
    return ckpt, fitted


def test_budgeted_cadences_are_said_at_fit_start_in_the_report_and_in_the_ledger(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_resilience"):
        ckpt = _fit(tmp_path, 30)
    said = [r.getMessage() for r in caplog.records if "checkpoint cadence" in r.getMessage()]
    assert any("tier 'memory': the 2.00% overhead budget decides; every step until" in m for m in said), said
    assert any("tier 'local': the 2.00% overhead budget decides; not written until" in m for m in said), said
    assert any(re.match(r"checkpoint cadence at step \d+: tier 'memory' every \d+ steps \(a snapshot", m) for m in said)

    section = json.loads((tmp_path / REPORT_NAME).read_text())["sections"]["checkpoint"]
    cadence = section["cadence"]
    assert cadence["overhead_budget"] == 0.02 and cadence["measured"]["step_s"] > 0
    for name in ("memory", "local"):
        chosen = cadence["tiers"][name]
        assert chosen["set_by"] in ("budget", "daly", "write") and chosen["reason"], chosen
        assert section["tiers"][name]["every_n_steps"] == chosen["every_n_steps"] >= 1
    assert section["tiers"]["local"]["writes"] >= 1  # the first persist measured its cost
    assert "cadence: tier 'memory': every" in ckpt.summary()

    ledger = json.loads((tmp_path / LEDGER_FILE).read_text())["attempts"][-1]["cadences"]
    assert {row[2] for row in ledger} == {"memory", "local"}
    assert all(isinstance(row[3], int) and row[4] for row in ledger)


def test_the_runs_failures_shorten_the_mtbf_the_cadences_assume(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="injected crash"):
        _fit(tmp_path, 30, CrashAt(6))
    ckpt = _fit(tmp_path, 12)
    assert ckpt.manager is not None
    report = ckpt.manager.cadence.report()
    assert report["failures_seen"] == 1 and report["mtbf_s"] < report["mtbf_prior_s"]


def test_the_detectors_work_is_counted_against_the_budget(tmp_path: Path) -> None:
    """SDC's guards and the straggler detector's step ends: their training-thread seconds reach the cadence
    controller, which leaves the tiers what they do not take (SDC's replay rounds, at their own cadence, are not
    counted)."""
    sdc = SDCVerification(SDCConfig(replay_every_n_steps=4))
    straggler = StragglerDetection()
    ckpt, fitted = _fit_trainer(tmp_path, 30, sdc, straggler)
    assert ckpt.manager is not None and sdc.monitor is not None
    stats = sdc.monitor.stats
    assert stats.replay_rounds >= 5 and stats.guard_seconds > 0 and stats.replay_seconds > 0 and straggler.spent_s > 0
    # what the suite counts: the guards and the straggler step ends, not the replay rounds
    counted = Suite.of(fitted).detector_seconds()
    assert counted == pytest.approx(stats.guard_seconds + straggler.spent_s, rel=1e-9)
    # what the controller took at its last review: a share of it, per step (in whole microseconds)
    measured = ckpt.manager.cadence.report()["measured"]
    assert 0 < measured["detectors_s"] <= counted + 1e-6, (measured, counted)
