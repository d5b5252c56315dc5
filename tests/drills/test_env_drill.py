"""The zero-code path under a real fault: a plain Lightning script with no import of lightning_resilience
(``_env_script.py``: ``DataLoader(shuffle=True)``, dropout, noise, StepLR, DDP on 2 CPU ranks), switched on by
``LIGHTNING_RESILIENCE`` alone, launched by torchrun, SIGKILLed mid-epoch on one rank, restarted by torchrun, ends
bitwise equal to an uninterrupted run. Lightning's default ``ModelCheckpoint`` (the script leaves checkpointing on)
is removed by the suite: neither run leaves a ``.ckpt`` file or a ``checkpoints/`` directory."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.drills._harness import Drill, drill_seed, first_difference, run_drill

pytestmark = pytest.mark.slow

ENV_SCRIPT = Path(__file__).with_name("_env_script.py")
STEPS, BATCHES_PER_EPOCH = 40, 25  # 400 samples, batch 8, 2 ranks


def _switch_on(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> None:
    setting = f"default run_dir={run_dir / 'suite'} checkpoint.tiers.1.every_n_steps=5"
    monkeypatch.setenv("LIGHTNING_RESILIENCE", setting)


def test_environment_alone_kill_mid_epoch_resumes_bitwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _switch_on(monkeypatch, tmp_path / "reference")
    reference = run_drill(Drill(script=ENV_SCRIPT, steps=STEPS), tmp_path / "reference")
    assert "lightning_resilience: enabled by LIGHTNING_RESILIENCE" in reference.log(), reference.log()
    assert all(r["restored_step"] is None for r in reference.reports.values())

    rng = random.Random(drill_seed())
    step = rng.choice([s for s in range(6, STEPS - 3) if s % BATCHES_PER_EPOCH and s % 5])  # between persists
    _switch_on(monkeypatch, tmp_path / "faulty")
    drill = Drill(fault="sigkill", step=step, rank=1, script=ENV_SCRIPT, steps=STEPS)
    result = run_drill(drill, tmp_path / "faulty")
    resumed = [r for r in result.reports.values() if r.get("restored_step") is not None]
    assert resumed and all(0 < r["restored_step"] <= step for r in resumed), result.reports
    assert len(result.finished) == 2, result.reports
    diff = first_difference(result.weights(), reference.weights())
    assert diff is None, f"killed after step {step}: {diff} (DRILL_SEED={drill_seed()}; logs in {tmp_path})"
    assert "Lightning's default ModelCheckpoint removed" in result.log(), result.log()
    leftovers = [*tmp_path.rglob("*.ckpt"), *tmp_path.rglob("checkpoints")]
    assert not leftovers, f"files the user did not ask for: {leftovers}"
