"""Every preset and every drill of the recipes, run in a subprocess for a few steps; exit codes and artefacts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_resilience import ExitCode
from tests.recipes.test_recipes import _run

RECIPE = [sys.executable, "-m", "recipes.pretrain_gpt"]


def _reports(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "report.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("preset", ["minimal", "default", "full"])
def test_each_preset_trains(tmp_path: Path, preset: str) -> None:
    proc = _run([*RECIPE, f"run_dir={tmp_path}", f"resilience={preset}", "trainer.max_steps=8"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _reports(tmp_path)[-1]["final_step"] == 8
    assert "tiered checkpoint:" in proc.stdout
    assert ("fault tolerance:" in proc.stdout) == (preset != "minimal")


def test_bad_value_fails_with_the_full_key(tmp_path: Path) -> None:
    proc = _run([*RECIPE, f"run_dir={tmp_path}", "resilience.checkpoint.tiers.1.keep=0"])
    assert proc.returncode != 0
    assert "resilience.checkpoint.tiers[1].keep must be >= 1, got 0" in proc.stderr


def test_preempt_drill_saves_and_exits_with_the_requeue_code(tmp_path: Path) -> None:
    proc = _run([*RECIPE, f"run_dir={tmp_path}", "drill=preempt", "drill.step=5", "trainer.max_steps=30"])
    assert proc.returncode == ExitCode.PREEMPTED, proc.stderr[-3000:]
    report = _reports(tmp_path)[-1]
    assert 5 <= report["final_step"] <= 7  # stopped at the agreed step boundary, not at max_steps
    steps = sorted(int(p.name.removeprefix("step_")) for p in (tmp_path / "ckpt").glob("step_*"))
    assert steps and steps[-1] == report["final_step"]  # the stop step was saved


def test_hang_drill_is_detected_dumped_and_ended(tmp_path: Path) -> None:
    proc = _run(
        [
            *RECIPE, f"run_dir={tmp_path}", "drill=hang", "drill.step=8", "trainer.max_steps=30",
            "resilience.ft.config.min_timeout_s=2", "resilience.ft.config.warmup_steps=3",
        ],
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == ExitCode.HANG, proc.stderr[-3000:]
    dumps = list((tmp_path / "resilience").rglob("*stack*"))
    assert dumps, sorted(str(p) for p in tmp_path.rglob("*"))


def test_slow_rank_drill_is_named(tmp_path: Path) -> None:
    """A single rank is judged against its own best history (a short window so it has one by the onset)."""
    overrides = ["drill=slow_rank", "drill.step=28", "drill.factor=3", "trainer.max_steps=44"]
    proc = _run([*RECIPE, f"run_dir={tmp_path}", *overrides, "resilience.straggler.config.window=8"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    named = "rank 0 (node 0" in proc.stdout and "slower in its own compute" in proc.stdout
    assert named and "(individual score" in proc.stdout, proc.stdout[-3000:]


def test_multirun_sweeps_presets(tmp_path: Path) -> None:
    proc = _run([*RECIPE, "-m", f"run_dir={tmp_path}", "resilience=minimal,default", "trainer.max_steps=3"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["final_step"] for r in _reports(tmp_path)] == [3, 3]


@pytest.mark.parametrize("recipe", ["pretrain_gpt", "finetune_classifier"])
def test_cli_runs_a_recipe(tmp_path: Path, recipe: str) -> None:
    cli = [sys.executable, "-m", "lightning_resilience.cli", "run", recipe]
    proc = _run([*cli, f"run_dir={tmp_path}", "resilience=full", "trainer.max_steps=6"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _reports(tmp_path)[-1]["final_step"] == 6


def test_finetune_classifier_from_an_exported_pretraining_step(tmp_path: Path) -> None:
    pre = tmp_path / "pre"
    proc = _run([*RECIPE, f"run_dir={pre}", "resilience=minimal", "trainer.max_steps=5"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = tmp_path / "gpt.ckpt"
    cli = [sys.executable, "-m", "lightning_resilience.cli"]
    proc = _run([*cli, "ckpt", "export", str(pre / "ckpt"), "--to", str(exported)])
    assert proc.returncode == 0 and exported.is_file(), proc.stderr[-3000:]
    ft = tmp_path / "ft"
    finetune = [sys.executable, "-m", "recipes.finetune_classifier", f"run_dir={ft}"]
    proc = _run([*finetune, f"model.init_from={exported}", "resilience=full", "trainer.max_steps=6"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _reports(ft)[-1]["final_step"] == 6
    assert (ft / "resilience_report.json").is_file()
    bad = _run([*finetune, f"run_dir={tmp_path / 'bad'}", f"model.init_from={tmp_path / 'missing.ckpt'}"])
    assert bad.returncode != 0 and "model.init_from: no checkpoint file" in bad.stderr


@pytest.mark.parametrize("policy", ["default", "lenient"])
def test_confirmed_straggler_goes_through_the_policy(tmp_path: Path, policy: str) -> None:
    """The strict ladder's top level asks the policy: by default it checkpoints and stops (exit 83), lenient alerts."""
    overrides = [
        "resilience/straggler=strict", f"resilience/policy={policy}", "resilience.straggler.config.window=8",
        "drill=slow_rank", "drill.step=28", "drill.factor=3", "trainer.max_steps=60",
    ]  # fmt: skip
    proc = _run([*RECIPE, f"run_dir={tmp_path}", *overrides])
    report = _reports(tmp_path)[-1]
    if policy == "default":
        assert proc.returncode == ExitCode.STRAGGLER, proc.stderr[-3000:]
        assert report["final_step"] < 60
        steps = sorted(int(p.name.removeprefix("step_")) for p in (tmp_path / "ckpt").glob("step_*"))
        assert steps[-1] == report["final_step"]  # checkpointed at the stop
        assert "checkpoint_and_stop" in proc.stdout
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert report["final_step"] == 60
        assert "resilience policy:" in proc.stdout and "alert" in proc.stdout


def test_bit_flip_drill_is_caught_and_recomputed(tmp_path: Path) -> None:
    # on a replay step of the full preset (every 50): caught before the optimizer step and recomputed in place
    proc = _run(
        [*RECIPE, f"run_dir={tmp_path}", "resilience=full", "drill=bit_flip", "drill.step=49", "trainer.max_steps=52"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[drill] injected FlipRecord" in proc.stdout
    assert "recomputed in place 1" in proc.stdout, proc.stdout[-3000:]
    report = json.loads((tmp_path / "resilience_report.json").read_text())
    sdc = report["sections"]["sdc_verification"]
    assert sdc["recomputed"] == 1 and sdc["detections"] == {"transient": 1} and not sdc["stopped"]


def test_slow_data_drill_is_named_in_data(tmp_path: Path) -> None:
    """``drill.where=data``: the batch arrives late on the rank; the detector names the wait for data."""
    overrides = ["drill=slow_rank", "drill.where=data", "drill.step=28", "drill.factor=3", "trainer.max_steps=44"]
    proc = _run([*RECIPE, f"run_dir={tmp_path}", *overrides, "resilience.straggler.config.window=8"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 (node 0" in proc.stdout and "slower in the wait for its next batch" in proc.stdout, proc.stdout[
        -3000:
    ]
