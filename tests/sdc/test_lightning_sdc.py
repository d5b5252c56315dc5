"""SDCVerification in a Lightning fit (one CPU process): no false positives on a clean run, a corrupt gradient is
recomputed in place (final weights bitwise equal to a clean run), a faulty device stops the fit with a verified
rollback step, and a fresh fit resumed there ends bitwise equal to the clean run."""

from __future__ import annotations

import json
import pickle
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from lightning_resilience import LocalTier, MemoryTier, TieredCheckpoint
from lightning_resilience.config.sdc import SDCConfig
from lightning_resilience.lightning.callbacks.sdc import VERDICT_FILE, SDCVerification
from lightning_resilience.lightning.callbacks.sdc_inject import BitFlipInjection
from lightning_resilience.sdc.inject import FlipSpec
from lightning_resilience.sdc.verdict import SDC_EXIT_CODE, SilentDataCorruptionError, Verdict
from tests.lightning._training import assert_bitwise_equal, build, trainer, weights

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
    assert (event.step, event.verdict, event.suspects, event.action) == (6, Verdict.TRANSIENT, [0], "recomputed")
    assert sdc.stats.recomputed == 1 and not sdc.stopped


def test_guard_triggers_replay_between_cadence_steps(clean: dict[str, torch.Tensor]) -> None:
    # replay cadence far away: only the non-finite / spike guards can trigger the replay that fixes the step; read
    # before the optimizer step (no lag), the guard catches the corrupt gradient before it is applied
    sdc = SDCVerification(SDCConfig(replay_every_n_steps=0, guard_min_history=4, guard_read_lag=0))
    inject = BitFlipInjection([FlipSpec("grad", step=7, bit_class="exponent", bit=30, seed=2)])
    assert_bitwise_equal(_fit([sdc, inject]), clean)
    [event] = sdc.events
    assert event.verdict is Verdict.TRANSIENT and event.action == "recomputed" and "guard" in event.mechanism


def test_nonfinite_gradient_read_late_stops_with_verified_rollback(
    tmp_path: Path, clean: dict[str, torch.Tensor]
) -> None:
    # the default read lag: the guard values of step 7 reach the host at step 8, after that update was applied; a
    # non-finite update cannot be fixed in place, so the fit stops and names the newest verified committed step
    tiers = [MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path / "ckpt", every_n_steps=3, keep=4)]
    config = SDCConfig(replay_every_n_steps=3, guard_min_history=4, rollback_tiers=["local"])
    sdc, ckpt = SDCVerification(config), TieredCheckpoint(tiers, resume="never")
    inject = BitFlipInjection([FlipSpec("grad", step=7, bit_class="exponent", bit=30, seed=2)])
    model, data = build()
    trainer(STEPS, [sdc, ckpt, inject, _SettlePersists(3)]).fit(model, datamodule=data)
    assert sdc.stopped and sdc.rollback_step == 6
    nonfinite = [e for e in sdc.events if e.mechanism == "guard:nonfinite"]
    assert [(e.step, e.action) for e in nonfinite] == [(9, "rollback")]
    assert sdc.stats.guard_fired.get("nonfinite_grad") == 1
    resumed = _fit([SDCVerification(SDCConfig(replay_every_n_steps=3)), TieredCheckpoint(tiers, resume=6)])
    assert_bitwise_equal(resumed, clean)


def test_faulty_device_stops_with_verified_rollback_then_resume_matches_clean(
    tmp_path: Path, clean: dict[str, torch.Tensor]
) -> None:
    tiers = [MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path / "ckpt", every_n_steps=3, keep=4)]
    config = SDCConfig(replay_every_n_steps=3, run_dir=str(tmp_path / "run"), rollback_tiers=["local"])
    sdc, ckpt = SDCVerification(config), TieredCheckpoint(tiers, resume="never")
    # from step 7 on, every gradient of one weight is corrupted (fresh element each time): no replay agrees
    model, data = build()
    faulty = _FaultyFrom(7, BitFlipInjection(faulty_rank=0, faulty_every_k=1, faulty_target="blocks.0.mlp.fc.weight"))
    trainer(STEPS, [sdc, ckpt, faulty, _SettlePersists(3)]).fit(model, datamodule=data)
    assert sdc.stopped and sdc.rollback_step == 6
    event = sdc.events[-1]
    assert event.step == 9 and event.verdict is Verdict.UNRESOLVED and event.suspects == [0]
    verdict = json.loads((tmp_path / "run" / VERDICT_FILE).read_text())
    assert verdict["rollback_step"] == 6 and verdict["suspects"][0]["rank"] == 0 and verdict["exit_code"] is None
    # the driver's restart: a fresh fit resumed at the verified step, on a healthy device
    resumed = _fit([SDCVerification(SDCConfig(replay_every_n_steps=3)), TieredCheckpoint(tiers, resume=6)])
    assert_bitwise_equal(resumed, clean)


def test_stop_on_suspect_raises_with_exit_code(tmp_path: Path) -> None:
    config = SDCConfig(replay_every_n_steps=2, run_dir=str(tmp_path), stop_on_suspect=True)
    inject = BitFlipInjection(faulty_rank=0, faulty_every_k=1, faulty_target="blocks.0.mlp.fc.weight")
    with pytest.raises(SilentDataCorruptionError) as info:
        _fit([SDCVerification(config), inject])
    assert info.value.exit_code == SDC_EXIT_CODE and info.value.suspects == [0]
    assert json.loads((tmp_path / VERDICT_FILE).read_text())["exit_code"] == SDC_EXIT_CODE


def test_callbacks_pickle_for_spawn() -> None:
    sdc = pickle.loads(pickle.dumps(SDCVerification(SDCConfig(replay_every_n_steps=5))))
    assert sdc.config.replay_every_n_steps == 5 and sdc.monitor is None
    inject = pickle.loads(pickle.dumps(BitFlipInjection([FlipSpec("param", step=1)])))
    assert inject.plan[0].location == "param"


class _SettlePersists(Callback):
    """Lets the in-flight persist finish before each persist step, so no persist is deferred to a later step on a
    loaded machine (the test wants the local tier to hold exactly every third step)."""

    def __init__(self, every_n_steps: int) -> None:
        self.every_n_steps = every_n_steps

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:  # type: ignore[no-untyped-def]
        if (trainer.global_step + 1) % self.every_n_steps == 0:
            for cb in trainer.callbacks:
                if isinstance(cb, TieredCheckpoint):
                    assert cb.manager is not None and cb.manager.wait(timedelta(seconds=30)), "persist too slow"


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
