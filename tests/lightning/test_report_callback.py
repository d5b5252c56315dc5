"""ResilienceReportCallback in a real Trainer with TieredCheckpoint and FaultTolerance: the report file, its
sections, the simulator reading it, and a report written when fit raises."""

from __future__ import annotations

import csv
import importlib.util
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.ft.config import FaultToleranceConfig
from lightning_resilience.lightning.callbacks.fault_tolerance import FaultTolerance
from lightning_resilience.lightning.callbacks.resilience_report import ResilienceReportCallback
from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint
from lightning_resilience.lightning.coordination import Suite
from lightning_resilience.report import REPORT_NAME
from lightning_resilience.sim.cli import simulate_main
from lightning_resilience.sim.from_run import load_run_costs
from tests.lightning._training import CrashAt, SettlePersists, build, trainer

pytestmark = pytest.mark.timeout(120)


def _ft(run_dir: Path) -> FaultTolerance:
    cfg = FaultToleranceConfig(
        run_dir=str(run_dir), warmup_steps=2, min_timeout_s=60.0, max_timeout_s=120.0, ledger_interval_s=0.0, nvrx="off"
    )
    return FaultTolerance(cfg)


class _Custom(Callback):
    """A component of the user's own contributes a section by registering with the Trainer's suite."""

    report_section = "custom"

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        Suite.of(trainer).add_reporter(self)

    def report(self) -> dict[str, Any]:
        return {"checked": 3, "ok": True}

    def summary(self) -> str:
        return "custom: 3 checked"


class BrokenThing(_Custom):
    report_section = "broken_thing"

    def report(self) -> dict[str, Any]:
        raise RuntimeError("figures unavailable")


class _CountingClock:
    """Every reading one second after the previous one."""

    def __init__(self) -> None:
        self.now = -1.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_report_of_a_finished_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    tiers = [MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path / "ckpt", every_n_steps=4, keep=2)]
    report_cb = ResilienceReportCallback(run_dir, clock=_CountingClock())
    model, data = build()
    # the local tier's writes land before the next is due: on a loaded machine one would be deferred otherwise
    callbacks = [_ft(run_dir), TieredCheckpoint(tiers), _Custom(), BrokenThing(), report_cb, SettlePersists(4)]
    trainer(12, callbacks).fit(model, datamodule=data)

    path = run_dir / REPORT_NAME
    assert report_cb.path == path and path.is_file()
    data_json = json.loads(path.read_text())
    sections = data_json["sections"]
    assert {"checkpoint", "fault_tolerance", "custom", "broken_thing", "run"} <= set(sections)
    assert sections["custom"] == {"checked": 3, "ok": True}
    assert sections["broken_thing"] == {"error": "RuntimeError: figures unavailable"}
    assert data_json["summaries"]["custom"] == "custom: 3 checked"
    assert data_json["summaries"]["checkpoint"].startswith("tiered checkpoint: 12 snapshots")

    ckpt = sections["checkpoint"]
    assert ckpt["captures"] == 12
    assert ckpt["tiers"]["memory"]["writes"] == 12 and ckpt["tiers"]["local"]["writes"] == 3  # steps 4, 8, 12
    assert ckpt["tiers"]["local"]["bytes"] > 0 and ckpt["tiers"]["local"]["write_seconds"] > 0
    # a snapshot is seen at the start of the next step: steps 1..11 (12 ends the run)
    assert [p[0] for p in ckpt["blocking_timeline"]] == list(range(1, 12))
    ft = sections["fault_tolerance"]
    assert ft["ettr"]["attempts"] == 1 and ft["exception"] is None
    assert sections["run"]["status"] == "finished" and sections["run"]["global_step"] == 12
    assert sections["run"]["steps_timed"] == 11

    costs = load_run_costs(run_dir)
    # the clock reads 1 s per step start; what checkpointing blocked is taken out of it
    assert costs.step_s is not None and 0.5 < costs.step_s < 1.0
    assert costs.gpus == 1 and costs.gpus_per_node == 1
    tiers_by_name = {t.name: t for t in costs.tiers}
    assert tiers_by_name["memory"].durability == "process" and tiers_by_name["memory"].blocking_s > 0
    assert tiers_by_name["local"].every_n_steps == 4 and tiers_by_name["local"].durability == "host"
    assert tiers_by_name["local"].blocking_s == 0.0 and tiers_by_name["local"].write_s > 0
    assert costs.failures == 0 and costs.failure_wall_s is not None and costs.failure_wall_s > 0

    out = capsys.readouterr().out
    assert "Resilience report" in out and "Checkpoints per tier" in out and "ETTR" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert (run_dir / "checkpoint_blocking.png") in report_cb.plot_files
        assert (run_dir / "checkpoint_blocking.png").read_bytes()[:4] == b"\x89PNG"

    clone = pickle.loads(pickle.dumps(report_cb))  # spawn launchers pickle callbacks
    assert clone.run_dir == run_dir and clone.print_table and clone.plots

    # the simulator takes the run's measured costs
    assert simulate_main(["--from-run", str(run_dir), "--gpus", "64", "--days", "1", "--json"]) == 0
    assert "step_s" in capsys.readouterr().out


def test_report_is_written_when_fit_raises(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    tiers = [MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path / "ckpt", every_n_steps=2, keep=2)]
    report_cb = ResilienceReportCallback(run_dir, print_table=False, plots=False)
    model, data = build()
    with pytest.raises(RuntimeError, match="injected crash"):
        trainer(10, [_ft(run_dir), TieredCheckpoint(tiers), CrashAt(4), report_cb]).fit(model, datamodule=data)
    assert "Resilience report" not in capsys.readouterr().out
    sections = json.loads((run_dir / REPORT_NAME).read_text())["sections"]
    assert sections["run"]["status"] == "exception: RuntimeError: injected crash at step 4"
    assert "injected crash at step 4" in sections["fault_tolerance"]["exception"]
    assert sections["fault_tolerance"]["attempts"][-1]["end_reason"] == "exception"
    assert not list(run_dir.glob("*.png"))
    costs = load_run_costs(run_dir)
    assert costs.failures == 1  # the attempt ended in a fault


class _CrashWithMarkup(Callback):
    """Raises what gloo raises when a peer dies: a message full of square brackets."""

    MESSAGE = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] closing tag [/bold] [red]"

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == 5:
            raise RuntimeError(self.MESSAGE)


def test_a_crash_with_markup_in_its_message_is_reported_with_its_table_and_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    report_cb = ResilienceReportCallback(run_dir)
    model, data = build()
    tiers = [MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path / "ckpt", every_n_steps=2, keep=2)]
    with caplog.at_level("INFO"), pytest.raises(RuntimeError, match="closing tag"):
        trainer(10, [_ft(run_dir), TieredCheckpoint(tiers), _CrashWithMarkup(), report_cb]).fit(model, datamodule=data)
    out = capsys.readouterr().out
    assert "could not" not in caplog.text
    assert "closing tag [/bold] [red]" in out and "[/__w/pytorch/" in out  # shown as written, not parsed
    assert f"resilience report: {run_dir / REPORT_NAME}" in out.replace("\n", "")
    report = json.loads((run_dir / REPORT_NAME).read_text())
    (attempt,) = report["attempts"]
    assert attempt["outcome"] == "fault" and attempt["cause"]["rank"] == 0
    assert attempt["cause"]["kind"] == "exception" and _CrashWithMarkup.MESSAGE in attempt["cause"]["detail"]
    # the crash came in a callback at the end of step 5, before the suite's step end recorded it (and captured it)
    assert report["timeline"]["attempts"][0]["last_step"] == 4
    if importlib.util.find_spec("matplotlib") is not None:
        assert report_cb.plot_files[0] == run_dir / "timeline.png" and (run_dir / "timeline.svg").is_file()


def test_metrics_reach_the_loggers_at_the_logging_cadence_as_host_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.loggers import CSVLogger

    through_module_log: list[str] = []
    original = LightningModule.log

    def spy(self: LightningModule, name: str, *args: Any, **kwargs: Any) -> None:
        through_module_log.append(name)
        original(self, name, *args, **kwargs)

    monkeypatch.setattr(LightningModule, "log", spy)
    run_dir = tmp_path / "run"
    model, data = build()
    tiers = [MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path / "ckpt", every_n_steps=4, keep=2)]
    callbacks = [_ft(run_dir), TieredCheckpoint(tiers), ResilienceReportCallback(run_dir, print_table=False)]
    fit = Trainer(
        max_steps=12, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path / "logs"), log_every_n_steps=4,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    fit.fit(model, datamodule=data)
    with open(next((tmp_path / "logs").rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    cadence = [int(r["step"]) for r in rows if r.get("resilience/report/step_time_s")]
    assert cadence == [4, 8]  # step 12 ends the run: its interval is never closed
    share = [
        float(r["resilience/report/checkpoint_blocking_share"]) for r in rows if r.get("resilience/report/step_time_s")
    ]
    assert all(0.0 <= v < 1.0 for v in share)
    (final,) = [r for r in rows if r.get("resilience/report/ettr")]
    assert int(final["step"]) == 12 and 0.0 < float(final["resilience/report/ettr"]) <= 1.0
    assert float(final["resilience/report/restarts"]) == 0.0 and float(final["resilience/report/faults"]) == 0.0
    assert not [n for n in through_module_log if n.startswith("resilience/report")]


def test_section_names() -> None:
    from lightning_resilience import SDCVerification, StragglerDetection

    names = [cb.report_section for cb in (FaultTolerance, SDCVerification, StragglerDetection)]
    assert names == ["fault_tolerance", "sdc_verification", "straggler_detection"]
