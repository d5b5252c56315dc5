"""The installed wheel, as a new user gets it: built from the checkout, installed into a fresh venv, used from a
directory that is not the checkout.

* the wheel holds ``lightning_resilience`` (with ``configs`` and ``recipes`` inside it) and our Hydra plugin, and no
  other top-level package;
* ``lightning-resilience run pretrain_gpt`` trains from a temporary directory;
* any Hydra app composes ``+resilience=default`` and ``resilience/checkpoint=tiered_s3`` (the search-path plugin);
* a plain Lightning script gets the suite from ``LIGHTNING_RESILIENCE`` alone (the ``callbacks_factory`` entry point).

The venv gets its dependencies the ordinary way (``pip install`` of the wheel, torch pinned to the CPU build first);
bounded to a few minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(cmd: list[str], cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LIGHTNING_RESILIENCE")}
    proc = subprocess.run(
        cmd, cwd=cwd, env={**clean, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)], dist, 300)
    (built,) = dist.glob("lightning_resilience-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel and its dependencies; returns its bin directory."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=True)
    pip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run([*pip, TORCH], env_dir, 600)  # the CPU build, as the README says, before anything can pull another one
    _run([*pip, str(wheel)], env_dir, 600)
    return env_dir / "bin"


def test_the_wheel_installs_inside_our_namespace_only(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith((".dist-info", ".data"))}
    assert top == {"lightning_resilience", "hydra_plugins"}, top  # no generic `recipes` or `configs` package
    assert "lightning_resilience/configs/resilience/default.yaml" in names
    assert "lightning_resilience/configs/resilience/checkpoint/tiered_s3.yaml" in names
    assert "lightning_resilience/configs/pretrain_gpt.yaml" in names
    assert "lightning_resilience/recipes/pretrain_gpt.py" in names
    assert "hydra_plugins/lightning_resilience_searchpath/__init__.py" in names
    assert not any(n.startswith("hydra_plugins/__init__") for n in names)  # Hydra's namespace stays open
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[lightning.pytorch.callbacks_factory]" in text and "callbacks_from_environment" in text


def test_cli_runs_a_recipe_from_any_directory(installed: Path, tmp_path: Path) -> None:
    proc = _run(
        [str(installed / "lightning-resilience"), "run", "pretrain_gpt", f"run_dir={tmp_path / 'run'}",
         "trainer.max_steps=4", "resilience.checkpoint.tiers.1.every_n_steps=2"],
        tmp_path, 300,
    )  # fmt: skip
    assert "tiered checkpoint:" in proc.stdout
    report = json.loads((tmp_path / "run" / "report.jsonl").read_text().splitlines()[-1])
    assert report["final_step"] == 4 and report["exit_code"] == 0
    assert (tmp_path / "run" / "ckpt" / f"step_{4:012d}").is_dir()


def test_any_hydra_app_composes_our_groups(installed: Path, tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text(
        textwrap.dedent(
            """
            import hydra
            from omegaconf import OmegaConf

            @hydra.main(version_base="1.3", config_path=None)
            def main(cfg):
                print("COMPOSED", OmegaConf.to_container(cfg.resilience.checkpoint, resolve=True))

            main()
            """
        )
    )
    proc = _run(
        [str(installed / "python"), str(app), "+resilience=default", "resilience/checkpoint=tiered_s3",
         "resilience.run_dir=/tmp/x", "hydra.run.dir=.", "hydra.output_subdir=null"],
        tmp_path, 120,
    )  # fmt: skip
    composed = proc.stdout.split("COMPOSED", 1)[1]
    assert "RemoteTierConfig" in composed and "/tmp/x/ckpt" in composed


def test_a_plain_lightning_script_gets_the_suite_from_the_environment(installed: Path, tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from lightning.pytorch import LightningModule, Trainer
            from torch.utils.data import DataLoader, TensorDataset

            class Model(LightningModule):
                def __init__(self):
                    super().__init__()
                    self.layer = torch.nn.Linear(4, 1)

                def training_step(self, batch, batch_idx):
                    x, y = batch
                    return torch.nn.functional.mse_loss(self.layer(x), y)

                def configure_optimizers(self):
                    return torch.optim.SGD(self.parameters(), lr=0.1)

            data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4, shuffle=True)
            trainer = Trainer(max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False)
            trainer.fit(Model(), data)
            print("CALLBACKS", sorted(type(cb).__name__ for cb in trainer.callbacks))
            """
        )
    )
    run = tmp_path / "run"
    proc = _run([str(installed / "python"), str(script)], tmp_path, 300, LIGHTNING_RESILIENCE=f"minimal run_dir={run}")
    assert "lightning_resilience: enabled by LIGHTNING_RESILIENCE: TieredCheckpoint(" in proc.stdout + proc.stderr
    assert "TieredCheckpoint" in proc.stdout.split("CALLBACKS", 1)[1]
    assert (run / "ckpt" / f"step_{6:012d}").is_dir() and (run / "resilience_report.json").is_file()
