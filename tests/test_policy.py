"""The resilience policy: verdicts posted on any rank become one action, taken by every rank at the same step (the
step after the one they were posted in: they travel in the next step's agreement); the suite carries it out whatever
the order of the callbacks, and the process ends with its code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_resilience import CheckpointConfig, DecidedExit, ExitCode, LocalTier, MemoryTier, Suite, TieredCheckpoint
from lightning_resilience.lightning.callbacks.policy import ResiliencePolicy
from lightning_resilience.policy import Action, Event, PolicyBus, PolicyConfig, Verdict
from tests._ranks import run_ranks
from tests.lightning._training import build, trainer


def test_config_rejects_actions_that_make_no_sense_for_the_event() -> None:
    with pytest.raises(ValueError, match=r"policy\.hang must be one of \['log', 'dump_and_exit'\], got 'rollback'"):
        PolicyConfig(hang="rollback")
    assert PolicyConfig(straggler="alert").mapping()["straggler"] == "alert"


def test_the_most_severe_action_wins_and_nothing_means_none() -> None:
    bus = PolicyBus(PolicyConfig(straggler="alert"))
    assert bus.decide(3, bus.contribute()) is None
    bus.post(Verdict(Event.STRAGGLER, 4, 0, "rank 0 1.5x slower"))
    bus.post(Verdict(Event.SDC_MISMATCH, 4, 0, "replica mismatch"))
    decision = bus.decide(4, bus.contribute())
    assert decision is not None and decision.action is Action.ROLLBACK and len(decision.verdicts) == 2
    assert decision.event is Event.SDC_MISMATCH and decision.exit_code is ExitCode.SDC
    assert bus.decide(5, bus.contribute()) is None  # verdicts are consumed by the decision
    assert [d["action"] for d in bus.report()["decisions"]] == ["rollback"]


def test_a_verdict_posted_after_the_round_waits_for_the_next_one() -> None:
    bus = PolicyBus(PolicyConfig())
    value = bus.contribute()  # the round of step 4 is issued at its start
    bus.post(Verdict(Event.STRAGGLER, 4, 0, "slow"))  # posted during step 4
    assert bus.decide(5, value) is None
    decision = bus.decide(6, bus.contribute())
    assert decision is not None and decision.step == 6 and decision.action is Action.CHECKPOINT_AND_STOP


def test_an_agreed_verdict_is_decided_without_a_round() -> None:
    bus = PolicyBus(PolicyConfig())
    bus.post(Verdict(Event.SDC_MISMATCH, 4, 0, "replicas differ"), agreed=True)
    decision = bus.decide(4, -1)  # nothing came from the round: every rank posted it alike
    assert decision is not None and decision.action is Action.ROLLBACK


def test_at_least_raises_the_mapped_action_and_the_exit_code_follows_the_event() -> None:
    bus = PolicyBus(PolicyConfig(sdc_mismatch="alert"))
    assert bus.post(Verdict(Event.SDC_MISMATCH, 2, 0, "persistent"), at_least=Action.ROLLBACK) is Action.ROLLBACK
    decision = bus.decide(2, bus.contribute())
    assert decision is not None and decision.action is Action.ROLLBACK and decision.exit_code == 84
    bus.post(Verdict(Event.STRAGGLER, 3, 0, "slow"))
    decision = bus.decide(3, bus.contribute())
    assert decision is not None and decision.exit_code is ExitCode.STRAGGLER


def _scenario_two_ranks(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    def reduce_max(value: int) -> int:
        t = torch.tensor([value])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    bus = PolicyBus(PolicyConfig())
    actions = []
    for step in range(1, 6):
        if rank == 1 and step == 3:  # only rank 1 sees the straggler
            bus.post(Verdict(Event.STRAGGLER, step, rank, "rank 1 slow"))
        decision = bus.decide(step, reduce_max(bus.contribute()))
        actions.append(None if decision is None else [step, decision.action.value, len(decision.verdicts)])
    return {"actions": actions}


def test_a_verdict_on_one_rank_is_acted_on_by_all() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_scenario_two_ranks, 2, Path(tmp))
    expected_step = [3, "checkpoint_and_stop"]
    for rank, res in enumerate(results):
        acted = [a for a in res["actions"] if a is not None]
        assert [a[:2] for a in acted] == [expected_step], (rank, res)
        assert acted[0][2] == (1 if rank == 1 else 0)  # the verdict itself stays on the rank that saw it


class _SlowRankDetector(Callback):
    """Stands in for a detector of the user's own: posts a straggler verdict at one step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            verdict = Verdict(Event.STRAGGLER, self.step, trainer.global_rank, "rank 0 2x slower")
            Suite.of(trainer).post(trainer, verdict)


@pytest.mark.parametrize("order", ["detector_first", "detector_last"])
@pytest.mark.parametrize("mapping", ["checkpoint_and_stop", "alert"])
def test_policy_stops_with_a_checkpoint_and_the_exit_code_or_only_alerts(
    tmp_path: Path, mapping: str, order: str
) -> None:
    model, data = build()
    tiers = [MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path, every_n_steps=100, keep=2)]
    policy = ResiliencePolicy(PolicyConfig(straggler=mapping))
    # no final flush at train end: a step-6 checkpoint can only come from the policy's checkpoint-and-stop
    ckpt = TieredCheckpoint(tiers, config=CheckpointConfig(persist_on_train_end=False))
    callbacks: list[Callback] = [_SlowRankDetector(6), policy, ckpt]
    t = trainer(20, callbacks if order == "detector_first" else callbacks[::-1])
    if mapping == "alert":
        t.fit(model, datamodule=data)
        assert t.global_step == 20 and policy.exit_code == 0
        assert tiers[1].list_steps() == []
    else:
        with pytest.raises(DecidedExit) as ended:  # no user code: the end of fit ends the process with the code
            t.fit(model, datamodule=data)
        assert ended.value.code == ExitCode.STRAGGLER == policy.exit_code
        # posted during step 6, agreed in the round of the next step, acted on at its end: saved before stopping
        assert t.global_step == 7 and 7 in tiers[1].list_steps()
    assert [d["action"] for d in policy.report()["decisions"]] == [mapping]


def test_exit_after_fit_false_leaves_the_exit_to_the_caller(tmp_path: Path) -> None:
    model, data = build()
    policy = ResiliencePolicy(PolicyConfig(exit_after_fit=False))
    tiers = [MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path, every_n_steps=100, keep=2)]
    t = trainer(20, [_SlowRankDetector(4), policy, TieredCheckpoint(tiers)])
    t.fit(model, datamodule=data)
    assert t.global_step == 5 and Suite.of(t).exit_code is ExitCode.STRAGGLER


def test_two_checkpoint_callbacks_are_refused(tmp_path: Path) -> None:
    model, data = build()
    a = TieredCheckpoint([MemoryTier(every_n_steps=1, keep=1)])
    b = TieredCheckpoint([MemoryTier(every_n_steps=1, keep=1, name="ram")])
    with pytest.raises(RuntimeError, match="more than one stateful callback"):  # Lightning's own check
        trainer(3, [a, b]).fit(model, datamodule=data)


def test_preemption_and_hang_settings_are_honoured(tmp_path: Path) -> None:
    """``preemption: log`` lets a noticed job train on (exit 0); ``hang: log`` keeps the hung rank alive."""
    from lightning_resilience import FaultTolerance
    from tests.ft.test_fault_tolerance_callback import NotifyAt, _config

    ft = FaultTolerance(_config(tmp_path / "run"))
    policy = ResiliencePolicy(PolicyConfig(preemption="log", hang="log"))
    model, data = build()
    t = trainer(10, [ft, policy, NotifyAt(3)])
    t.fit(model, datamodule=data)
    assert ft.preempted_at == 4 and t.global_step == 10 and policy.exit_code == 0
    assert [d["action"] for d in policy.report()["decisions"]] == ["log"]
    assert ft._hang_handler is not None and ft._hang_handler.exit is False
    # the default mapping ends a hung rank
    ft = FaultTolerance(_config(tmp_path / "run2"))
    trainer(2, [ft]).fit(*build())
    assert ft._hang_handler is not None and ft._hang_handler.exit is True
