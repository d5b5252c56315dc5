"""The switch without code: ``LIGHTNING_RESILIENCE`` and ``+resilience=...`` read by the ``callbacks_factory`` entry
point, bad input stopped before training with a message that names it, and a Trainer's own callbacks never added
twice."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resilience import LocalTier, MemoryTier, Suite, TieredCheckpoint
from lightning_resilience.config.registry import ResilienceConfigError
from lightning_resilience.lightning.suite import (
    ENV_VAR,
    ResilienceSuite,
    build_suite,
    callbacks_from_environment,
    compose_resilience,
    enablement,
)
from tests.lightning._training import build, trainer

ROOT = Path(__file__).resolve().parents[2]


def _names(callbacks: list) -> list[str]:
    return [type(cb).__name__ for cb in callbacks]


def test_off_unless_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert enablement({}) is None and callbacks_from_environment() == []
    assert enablement({ENV_VAR: "off"}) is None and enablement({ENV_VAR: " "}) is None


def test_environment_settings_are_relative_to_resilience(tmp_path: Path) -> None:
    switch = enablement({ENV_VAR: f"default run_dir={tmp_path} checkpoint.tiers.1.every_n_steps=50 sdc=dual_run"})
    assert switch is not None and switch.overrides == [
        "+resilience=default",
        f"resilience.run_dir={tmp_path}",
        "resilience.checkpoint.tiers.1.every_n_steps=50",
        "resilience/sdc=dual_run",
    ]
    callbacks = build_suite(compose_resilience(switch.overrides))
    assert _names(callbacks) == [
        "TieredCheckpoint", "StragglerDetection", "SDCVerification", "FaultTolerance", "ResiliencePolicy",
        "ResilienceReportCallback",
    ]  # fmt: skip
    ckpt, sdc = callbacks[0], callbacks[2]
    assert isinstance(ckpt, TieredCheckpoint) and ckpt.tiers[1].every_n_steps == 50
    assert Path(ckpt.tiers[1].root) == tmp_path / "ckpt" and sdc.config.replay_every_n_steps == 50  # type: ignore[attr-defined]


def test_a_yaml_file_is_a_preset_of_its_own(tmp_path: Path) -> None:
    preset = tmp_path / "mine.yaml"
    preset.write_text("defaults:\n  - checkpoint: memory\n  - _self_\nrun_dir: /tmp/mine\n")
    switch = enablement({ENV_VAR: f"{preset} checkpoint.tiers.0.keep=4"})
    assert switch is not None
    (ckpt,) = build_suite(compose_resilience(switch.overrides))
    assert isinstance(ckpt, TieredCheckpoint) and [type(t) for t in ckpt.tiers] == [MemoryTier]
    assert ckpt.tiers[0].keep == 4


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("defualt", "LIGHTNING_RESILIENCE: unknown preset 'defualt'; available: default, full, minimal"),
        ("default checkpoint.tier=3", "LIGHTNING_RESILIENCE: unknown key 'checkpoint.tier'"),
        (
            "default checkpoint=nvme",
            "LIGHTNING_RESILIENCE: unknown checkpoint option 'nvme'; available: budget, local, memory",
        ),
        (
            "default ft.config.safety_factor=lots",
            "LIGHTNING_RESILIENCE: bad value for 'ft.config.safety_factor': Value 'lots' of type 'str' could not be",
        ),
        (
            "default checkpoint.tiers.1.every_n_steps=-1",
            "LIGHTNING_RESILIENCE: resilience.checkpoint.tiers[1].every_n_steps must be >= 1, or 0 (the cost budget "
            "decides), got -1",
        ),
        ("run_dir=/x", "LIGHTNING_RESILIENCE must start with a preset (default, full, minimal) or a YAML file"),
        ("default verbose", "LIGHTNING_RESILIENCE: expected key=value after the preset, got 'verbose'"),
        ("missing.yaml", "LIGHTNING_RESILIENCE: no such file 'missing.yaml'"),
    ],
)
def test_bad_input_stops_the_trainer_before_training(monkeypatch: pytest.MonkeyPatch, value: str, message: str) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(ResilienceConfigError) as err:
        Trainer(accelerator="cpu", logger=False, max_steps=1)  # Lightning asks the entry point while it builds
    assert str(err.value).startswith(message), str(err.value)


def test_the_trainer_own_callbacks_are_kept_and_the_rest_added(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, f"default run_dir={tmp_path / 'suite'}")
    mine = TieredCheckpoint([MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path / "mine", every_n_steps=3)])
    model, data = build()
    fit = trainer(6, [mine])
    (switch,) = [cb for cb in fit.callbacks if isinstance(cb, ResilienceSuite)]  # type: ignore[attr-defined]
    fit.fit(model, datamodule=data)
    assert switch.kept == [mine] and "TieredCheckpoint" not in _names(switch.added)
    assert {"StragglerDetection", "SDCVerification", "FaultTolerance"} <= set(_names(switch.added))
    present = _names(fit.callbacks)  # type: ignore[attr-defined]
    assert present.count("TieredCheckpoint") == 1 and present.count("FaultTolerance") == 1
    assert Suite.of(fit).checkpoint is mine and mine.tiers[1].list_steps()  # ours did not replace the user's
    assert not (tmp_path / "suite" / "ckpt").exists() and (tmp_path / "suite" / "resilience_report.json").is_file()


def _fit_switched_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, callbacks: list) -> Trainer:
    """A Trainer as a user builds it (checkpointing left on), switched on by the environment."""
    monkeypatch.setenv(ENV_VAR, f"default run_dir={tmp_path / 'suite'}")
    model, data = build()
    fit = Trainer(max_steps=14, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                  limit_val_batches=0, default_root_dir=tmp_path / "root", callbacks=callbacks)  # fmt: skip
    fit.fit(model, datamodule=data)  # 12 batches an epoch: an epoch's end, where a ModelCheckpoint writes
    return fit


def test_lightning_default_model_checkpoint_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The user asked for TieredCheckpoint only: no full .ckpt file at every epoch's end, no checkpoints/ directory."""
    with caplog.at_level(logging.INFO):
        fit = _fit_switched_on(tmp_path, monkeypatch, [])
    (switch,) = [cb for cb in fit.callbacks if isinstance(cb, ResilienceSuite)]  # type: ignore[attr-defined]
    assert [type(cb) for cb in switch.removed] == [ModelCheckpoint]
    assert not any(isinstance(cb, ModelCheckpoint) for cb in fit.callbacks)  # type: ignore[attr-defined]
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("checkpoints"))
    assert (tmp_path / "suite" / "ckpt" / f"step_{14:012d}").is_dir()
    assert f"Lightning's default ModelCheckpoint removed (no .ckpt files in {tmp_path / 'root' / 'checkpoints'})" in (
        caplog.text
    )


def test_a_model_checkpoint_the_user_configured_stays_and_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    mine = ModelCheckpoint(dirpath=tmp_path / "mine", every_n_train_steps=7)
    with caplog.at_level(logging.INFO):
        fit = _fit_switched_on(tmp_path, monkeypatch, [mine])
    (switch,) = [cb for cb in fit.callbacks if isinstance(cb, ResilienceSuite)]  # type: ignore[attr-defined]
    assert switch.removed == [] and mine in fit.callbacks  # type: ignore[attr-defined]
    assert [p.name for p in (tmp_path / "mine").glob("*.ckpt")] == ["epoch=1-step=14.ckpt"]
    assert f"the Trainer's own ModelCheckpoint kept: it writes full .ckpt files in {tmp_path / 'mine'}" in caplog.text


def test_a_hydra_app_switched_on_by_its_overrides(tmp_path: Path) -> None:
    """A plain Hydra app (nothing of ours imported): ``+resilience=minimal`` on its command line is the switch."""
    app = tmp_path / "app.py"
    app.write_text(
        textwrap.dedent(
            """
            import hydra
            import torch
            from lightning.pytorch import LightningModule, Trainer
            from torch.utils.data import DataLoader, TensorDataset

            class Model(LightningModule):
                def __init__(self):
                    super().__init__()
                    self.layer = torch.nn.Linear(4, 1)

                def training_step(self, batch, batch_idx):
                    return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

                def configure_optimizers(self):
                    return torch.optim.SGD(self.parameters(), lr=0.1)

            @hydra.main(version_base="1.3", config_path=None)
            def main(cfg):
                data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
                trainer = Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False)
                trainer.fit(Model(), data)

            main()
            """
        )
    )
    run = tmp_path / "run"
    cmd = [sys.executable, str(app), "+resilience=minimal", f"resilience.run_dir={run}", "hydra.run.dir=.",
           "hydra.output_subdir=null"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop(ENV_VAR, None)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lightning_resilience: enabled by the Hydra overrides: TieredCheckpoint(" in proc.stdout + proc.stderr
    assert (run / "ckpt" / f"step_{3:012d}").is_dir()
    assert not list(tmp_path.rglob("*.ckpt")), "Lightning's default ModelCheckpoint was not removed"
    bad = subprocess.run([*cmd, "resilience.checkpoint.tiers.1.keep=0"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)  # fmt: skip
    assert bad.returncode != 0 and "resilience.checkpoint.tiers[1].keep must be >= 1, got 0" in bad.stderr
