"""SDCVerification in a Lightning fit (one CPU process): no false positives on a clean run, a corrupt gradient is
recomputed in place (final weights bitwise equal to a clean run), a faulty device stops the fit with a verified
rollback step and exit code SDC, and the next attempt — same config, automatic resume — restores at most the
verified step, deletes the suspect ones and ends bitwise equal to the clean run."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from lightning_resilience import DecidedExit, ExitCode, LocalTier, MemoryTier, TieredCheckpoint
from lightning_resilience.checkpoint.certify import TOMBSTONE
from lightning_resilience.checkpoint.layout import step_dirname
from lightning_resilience.lightning.callbacks.policy import ResiliencePolicy
from lightning_resilience.lightning.callbacks.sdc import VERDICT_FILE, SDCVerification
from lightning_resilience.lightning.callbacks.sdc_inject import BitFlipInjection
from lightning_resilience.lightning.coordination import RESTORE_BOUND_FILE
from lightning_resilience.policy import PolicyConfig
from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.sdc.inject import FlipSpec
from lightning_resilience.sdc.verdict import Diagnosis
from tests.lightning._training import SettlePersists, assert_bitwise_equal, build, trainer, weights

pytestmark = pytest.mark.timeout(120)

STEPS = 12


@pytest.fixture(scope="module")
def clean() -> dict[str, torch.Tensor]:
    model, data = build()
    trainer(STEPS, []).fit(model, datamodule=data)
    return weights(model)


def _fit(callbacks: list, steps: int = STEPS) -> dict[str, torch.Tensor]:
    model, data = build()
    trainer(steps, callbacks).fit(model, datamodule=data)
    return weights(model)


def test_clean_run_has_no_detection_and_same_weights(clean: dict[str, torch.Tensor]) -> None:
    sdc = SDCVerification(SDCConfig(replay_every_n_steps=1, param_norm_every_n_steps=1))
    assert_bitwise_equal(_fit([sdc]), clean)  # replays do not disturb RNG streams or gradients
    assert sdc.stats.replay_rounds == STEPS and sdc.stats.replays == STEPS
    assert sdc.events == [] and sdc.stats.detections == {}
    assert sdc.report()["newest_verified_step"] == STEPS
    assert "12 steps guarded" in sdc.summary()


@pytest.mark.parametrize("location", ["grad", "activation"])
@pytest.mark.parametrize("bit_class", ["sign", "exponent"])
def test_corrupt_gradient_is_recomputed_in_place(clean: dict[str, torch.Tensor], location: str, bit_class: str) -> None:
    sdc = SDCVerification(SDCConfig(replay_every_n_steps=1))
    inject = BitFlipInjection([FlipSpec(location, step=5, bit_class=bit_class, seed=11)])  # type: ignore[arg-type]
    assert_bitwise_equal(_fit([sdc, inject]), clean)
    assert len(inject.records) == 1
    [event] = sdc.events
    assert (event.step, event.verdict, event.suspects, event.action) == (6, Diagnosis.TRANSIENT, [0], "recomputed")
    assert sdc.stats.recomputed == 1 and not sdc.stopped


def test_guard_triggers_replay_between_cadence_steps(clean: dict[str, torch.Tensor]) -> None:
    # replay cadence far away: only the non-finite / spike guards can trigger the replay that fixes the step; read
    # before the optimizer step (no lag), the guard catches the corrupt gradient before it is applied
    sdc = SDCVerification(SDCConfig(replay_every_n_steps=0, guard_min_history=4, guard_read_lag=0))
    inject = BitFlipInjection([FlipSpec("grad", step=7, bit_class="exponent", bit=30, seed=2)])
    assert_bitwise_equal(_fit([sdc, inject]), clean)
    [event] = sdc.events
    assert event.verdict is Diagnosis.TRANSIENT and event.action == "recomputed" and "guard" in event.mechanism


def test_nonfinite_gradient_read_late_stops_with_verified_rollback(
    tmp_path: Path, clean: dict[str, torch.Tensor]
) -> None:
    # the default read lag: the guard values of step 7 reach the host at step 8, after that update was applied; a
    # non-finite update cannot be fixed in place: with policy.nonfinite=rollback the fit stops (exit code SDC) naming
    # the newest verified step (the default, an in-process rollback, is tested in tests/rollback)
    tiers = [MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path / "ckpt", every_n_steps=3, keep=4)]
    config = SDCConfig(replay_every_n_steps=3, guard_min_history=4, rollback_tiers=["local"], run_dir=str(tmp_path))
    sdc, ckpt = SDCVerification(config), TieredCheckpoint(tiers, resume="never")
    inject = BitFlipInjection([FlipSpec("grad", step=7, bit_class="exponent", bit=30, seed=2)])
    model, data = build()
    with pytest.raises(DecidedExit) as ended:
        policy = ResiliencePolicy(PolicyConfig(nonfinite="rollback"))
        trainer(STEPS, [sdc, ckpt, inject, policy, SettlePersists(3)]).fit(model, datamodule=data)
    assert ended.value.code == ExitCode.SDC and sdc.stopped and sdc.rollback_step == 6
    nonfinite = [e for e in sdc.events if e.mechanism == "guard:nonfinite"]
    assert [(e.step, e.action) for e in nonfinite] == [(9, "rollback")]
    assert sdc.stats.guard_fired.get("nonfinite_grad") == 1
    # the restart: same config, automatic resume, restores the verified step
    again = TieredCheckpoint(
        [MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path / "ckpt", every_n_steps=3, keep=4)]
    )
    resumed = _fit([SDCVerification(config), again])
    assert again.stats.restored_step == 6
    assert_bitwise_equal(resumed, clean)


def _tiers(root: Path) -> list:
    # every step on disk: the corrupt steps before the detection are committed too (the restart must skip them)
    return [MemoryTier(every_n_steps=1, keep=2), LocalTier(root / "ckpt", every_n_steps=1, keep=12)]


@pytest.mark.parametrize("mapping", ["rollback", "alert"])
def test_faulty_device_ends_with_sdc_code_and_the_restart_restores_the_verified_step(
    tmp_path: Path, clean: dict[str, torch.Tensor], mapping: str
) -> None:
    """Whatever the policy does about it (stop, or only alert and train on), a corrupt state ends the process with
    ExitCode.SDC, and the next attempt never restores a step newer than the verified one."""
    config = SDCConfig(replay_every_n_steps=3, run_dir=str(tmp_path / "run"), rollback_tiers=["local"])
    policy = ResiliencePolicy(PolicyConfig(sdc_mismatch=mapping))
    sdc, ckpt = SDCVerification(config), TieredCheckpoint(_tiers(tmp_path))
    # from step 7 on, every gradient of one weight is corrupted (fresh element each time): no replay agrees
    model, data = build()
    faulty = _FaultyFrom(7, BitFlipInjection(faulty_rank=0, faulty_every_k=1, faulty_target="blocks.0.mlp.fc.weight"))
    with pytest.raises(DecidedExit) as ended:
        trainer(STEPS, [sdc, ckpt, faulty, SettlePersists(1), policy]).fit(model, datamodule=data)
    assert ended.value.code == ExitCode.SDC == 84
    assert sdc.rollback_step == 6 and sdc.stopped == (mapping == "rollback")
    event = next(e for e in sdc.events if e.verdict is not Diagnosis.CLEAN)
    # one device whose replays never agree: nothing reproduces a reference, so no rank is named
    assert event.step == 9 and event.verdict is Diagnosis.INCONCLUSIVE and event.suspects == []
    verdict = json.loads((tmp_path / "run" / VERDICT_FILE).read_text())
    assert verdict["rollback_step"] == 6 and verdict["suspects"] == [] and verdict["exit_code"] == 84
    bound = json.loads((tmp_path / "run" / RESTORE_BOUND_FILE).read_text())
    assert bound["max_step"] == 6 and bound["detected_at"] == 9
    on_disk = ckpt.tiers[1].list_steps()
    # the suspect steps committed before the detection are rejected at once, in every tier; none is taken after
    assert max(on_disk) == 6 and sdc.rejected_steps == [7, 8]
    assert all((tmp_path / "ckpt" / step_dirname(s) / TOMBSTONE).is_file() for s in (7, 8))
    # the launcher's restart: a new process, the same config, automatic resume, a healthy device
    again = TieredCheckpoint(_tiers(tmp_path))
    resumed = _fit([SDCVerification(config), again])
    assert again.stats.restored_step == 6 and again.discarded_suspect == [s for s in on_disk if s > 6]
    assert not (tmp_path / "run" / RESTORE_BOUND_FILE).exists()  # lifted once the suspect steps are gone
    assert_bitwise_equal(resumed, clean)


def test_stop_on_suspect_stops_even_where_the_policy_would_only_alert(tmp_path: Path) -> None:
    config = SDCConfig(replay_every_n_steps=2, run_dir=str(tmp_path), stop_on_suspect=True)
    inject = BitFlipInjection(faulty_rank=0, faulty_every_k=1, faulty_target="blocks.0.mlp.fc.weight")
    sdc = SDCVerification(config)
    model, data = build()
    fit = trainer(STEPS, [sdc, inject, ResiliencePolicy(PolicyConfig(sdc_mismatch="log"))])
    with pytest.raises(DecidedExit) as ended:
        fit.fit(model, datamodule=data)
    assert ended.value.code == ExitCode.SDC and sdc.stopped and fit.global_step < STEPS
    assert json.loads((tmp_path / VERDICT_FILE).read_text())["exit_code"] == ExitCode.SDC


def test_callbacks_pickle_for_spawn() -> None:
    sdc = pickle.loads(pickle.dumps(SDCVerification(SDCConfig(replay_every_n_steps=5))))
    assert sdc.config.replay_every_n_steps == 5 and sdc.monitor is None
    inject = pickle.loads(pickle.dumps(BitFlipInjection([FlipSpec("param", step=1)])))
    assert inject.plan[0].location == "param"


class _FaultyFrom(BitFlipInjection):
    """Arms the wrapped faulty device only from ``step`` on."""

    def __init__(self, step: int, inner: BitFlipInjection) -> None:
        super().__init__()
        self.step, self.inner = step, inner

    def on_train_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        pass

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            self.inner.on_train_start(trainer, pl_module)

    def teardown(self, trainer, pl_module, stage) -> None:  # type: ignore[no-untyped-def]
        self.inner.teardown(trainer, pl_module, stage)
