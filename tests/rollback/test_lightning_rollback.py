"""In-process rollback in a Trainer (one process, the default policy): a NaN sample rolls the run back from RAM and
is skipped, the run equals one whose loader never lists that batch, and past the cap per window the job restores
the good state, persists it and stops with ExitCode.DIVERGED."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import DataLoader

from lightning_resilience import (
    DecidedExit,
    ExitCode,
    LocalTier,
    MemoryTier,
    ResiliencePolicy,
    RollbackConfig,
    SDCConfig,
    SDCVerification,
    Suite,
    TieredCheckpoint,
)
from lightning_resilience.policy import PolicyConfig
from lightning_resilience.report.render import _rollback_rows
from lightning_resilience.rollback import read_quarantine
from tests.drills._rollback_script import PoisonedPoints
from tests.drills._user_code import Regressor

pytestmark = pytest.mark.timeout(180)

BATCH = 8


def _fit(run: Path, poison: list[int], steps: int, *, sampler: Any = None, policy: ResiliencePolicy | None = None,
         local: bool = False, scale: float = float("nan")) -> tuple[Trainer, torch.nn.Module]:  # fmt: skip
    seed_everything(5)
    loader = DataLoader(_Many(poison, scale), batch_size=BATCH, sampler=sampler)  # sequential: sample i in batch i//8
    tiers: list[Any] = [MemoryTier(every_n_steps=1, keep=2)]
    if local:
        tiers.append(LocalTier(run / "ckpt", every_n_steps=100, keep=2))
    callbacks: list[Any] = [TieredCheckpoint(tiers, resume="never"),
                            SDCVerification(SDCConfig(run_dir=str(run), replay_every_n_steps=0))]  # fmt: skip
    if policy is not None:
        callbacks.append(policy)
    model = Regressor()
    trainer = Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(run))  # fmt: skip
    trainer.fit(model, loader)
    return trainer, model


class _Many(PoisonedPoints):
    """Several poisoned samples (NaN features, or features scaled by ``scale``)."""

    def __init__(self, poison: list[int], scale: float = float("nan")) -> None:
        super().__init__(-1)
        self.poisoned, self.scale = set(poison), scale

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(idx)
        return (x * self.scale, y) if idx in self.poisoned else (x, y)


def test_a_nan_sample_is_rolled_back_and_skipped_and_the_run_equals_one_without_its_batch(tmp_path: Path) -> None:
    poison = 5 * BATCH + 2  # batch 5 of the (sequential) epoch: step 5
    trainer, model = _fit(tmp_path / "run", [poison], steps=20)
    assert trainer.global_step == 20 and all(torch.isfinite(p).all() for p in model.parameters())
    [record] = read_quarantine(tmp_path / "run" / "quarantine.jsonl")
    assert (record["cause"], record["bad_step"], record["target"], record["escalated"]) == ("nonfinite", 5, 5, False)
    assert record["skipped"] == {"0": list(range(5 * BATCH, 6 * BATCH))} and record["steps_lost"] == 2
    suite = Suite.of(trainer)
    assert suite.exit_code is ExitCode.OK and "rollback at step 7 (nonfinite)" in suite.summary()
    [row] = _rollback_rows("resilience_policy", suite.report()["rollback"])
    assert "bad step 5" in row[1] and "2 step(s) lost" in row[1] and "8 sample(s) quarantined" in row[1]
    without = [i for i in range(400) if i // BATCH != 5]
    _, reference = _fit(tmp_path / "reference", [poison], steps=20, sampler=without)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name


def test_past_the_cap_the_good_state_is_persisted_and_the_job_stops_diverged(tmp_path: Path) -> None:
    policy = ResiliencePolicy(PolicyConfig(rollback=RollbackConfig(max_rollbacks=1, window_steps=50)))
    with pytest.raises(DecidedExit) as ended:
        _fit(tmp_path, [3 * BATCH, 9 * BATCH + 1], steps=20, policy=policy, local=True)
    assert ended.value.exit_code is ExitCode.DIVERGED == 89
    first, second = read_quarantine(tmp_path / "quarantine.jsonl")
    assert (first["bad_step"], first["escalated"], len(first["skipped"]["0"])) == (3, False, BATCH)
    # the second bad batch comes one step later in the run that skipped the first one
    assert (second["bad_step"], second["target"], second["escalated"], second["skipped"]) == (8, 8, True, {})
    persisted = LocalTier(tmp_path / "ckpt", every_n_steps=100, keep=2).list_steps()
    assert persisted == [8]  # the restored good state, not the NaN one it replaced
    assert policy.suite is not None and policy.suite.decision is not None
    assert policy.suite.decision.action.value == "checkpoint_and_stop"


def test_spikes_roll_back_when_opted_in(tmp_path: Path) -> None:
    # a finite sample 1000x off the data: its loss is a spike against the guard's baseline (8 steps of history)
    policy = ResiliencePolicy(PolicyConfig(spike="rollback_in_process"))
    trainer, _ = _fit(tmp_path, [12 * BATCH + 4], steps=20, policy=policy, scale=1000.0)
    assert trainer.global_step == 20
    [record] = read_quarantine(tmp_path / "quarantine.jsonl")
    assert (record["cause"], record["bad_step"], record["target"]) == ("spike", 12, 12)
    assert 12 * BATCH + 4 in record["skipped"]["0"]


class _FaultAtStep(Regressor):
    """A fault tied to a step, as a flaky device at a deterministic kernel: the loss of step ``step`` is NaN each
    of the first ``times`` times that step runs, whatever its batch."""

    def __init__(self, step: int, times: int) -> None:
        super().__init__()
        self.step, self.times, self.runs = step, times, 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == self.step and self.runs < self.times:
            self.runs += 1
            return loss * float("nan")
        return loss


def _fit_fault(run: Path, times: int, policy: ResiliencePolicy | None = None,
               sampler: Any = None) -> tuple[Trainer, _FaultAtStep]:  # fmt: skip
    seed_everything(5)
    loader = DataLoader(_Many([]), batch_size=BATCH, sampler=sampler)
    callbacks: list[Any] = [TieredCheckpoint([MemoryTier(every_n_steps=1, keep=2),
                                              LocalTier(run / "ckpt", every_n_steps=100, keep=2)], resume="never"),
                            SDCVerification(SDCConfig(run_dir=str(run), replay_every_n_steps=0))]  # fmt: skip
    if policy is not None:
        callbacks.append(policy)
    model = _FaultAtStep(6, times)
    trainer = Trainer(max_steps=14, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(run))  # fmt: skip
    trainer.fit(model, loader)
    return trainer, model


def test_a_fault_that_recurs_at_the_restored_step_is_rolled_back_again(tmp_path: Path) -> None:
    trainer, model = _fit_fault(tmp_path, times=2)
    assert model.runs == 2 and trainer.global_step == 14 and all(torch.isfinite(p).all() for p in model.parameters())
    first, second = read_quarantine(tmp_path / "quarantine.jsonl")
    # the second fault comes at the rerun of step 6, which the first rollback restored: still in RAM
    assert [(r["bad_step"], r["target"], r["escalated"]) for r in (first, second)] == [(6, 6, False), (6, 6, False)]
    assert (first["skipped"], second["skipped"]) == ({"0": list(range(48, 56))}, {"0": list(range(56, 64))})
    assert Suite.of(trainer).exit_code is ExitCode.OK
    # the state kept after the first rollback is the restored one, quarantine included: the run equals one whose
    # loader never lists either batch
    without = [i for i in range(400) if i // BATCH not in (6, 7)]
    _, reference = _fit_fault(tmp_path / "reference", times=0, sampler=without)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name


def test_past_the_cap_a_fault_tied_to_its_step_stops_for_a_restart_elsewhere_and_says_so(tmp_path: Path) -> None:
    policy = ResiliencePolicy(PolicyConfig(rollback=RollbackConfig(max_rollbacks=2)))
    with pytest.raises(DecidedExit) as ended:
        _fit_fault(tmp_path, times=10**6, policy=policy)
    records = read_quarantine(tmp_path / "quarantine.jsonl")
    assert [(r["bad_step"], r["escalated"]) for r in records] == [(6, False), (6, False), (6, True)]
    # the message and the exit code agree: the same step failed with three batches, a restart elsewhere can help
    code = ended.value.exit_code
    assert code is ExitCode.SDC and f"exit code {int(code)} (SDC)" in records[-1]["detail"]
    assert "came back at step 6" in records[-1]["detail"]
    assert LocalTier(tmp_path / "ckpt", every_n_steps=100, keep=2).list_steps() == [6]  # the good state persisted
