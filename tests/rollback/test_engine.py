"""The in-process rollback engine: the plan (target, steps back, the cap per window), the learning-rate cool-down,
the quarantine file, the config's validation, and the policy's reduction of the new action."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from lightning_resilience._configurable import ConfigError
from lightning_resilience.exit_codes import ExitCode
from lightning_resilience.policy import Action, Decision, Event, PolicyBus, PolicyConfig, Verdict
from lightning_resilience.rollback import (
    LrCooldown,
    RollbackConfig,
    RollbackGovernor,
    RollbackRecord,
    append_quarantine,
    quarantined_indices,
    read_quarantine,
)


def _record(bad: int, target: int, escalated: bool = False) -> RollbackRecord:
    return RollbackRecord(cause="nonfinite", bad_step=bad, detected_at=bad + 2, target=target,
                          steps_lost=2, escalated=escalated)  # fmt: skip


def test_plan_restores_the_newest_common_snapshot_not_after_the_bad_step() -> None:
    governor = RollbackGovernor(RollbackConfig())
    plan = governor.plan(bad_step=5, detected_at=7, common_steps=[4, 5, 6])
    assert (plan.target, plan.escalate) == (5, False)
    assert RollbackGovernor(RollbackConfig(steps_back=1)).plan(5, 7, [3, 4, 5, 6]).target == 4


def test_plan_without_an_old_enough_snapshot_escalates_with_nothing_to_restore() -> None:
    plan = RollbackGovernor(RollbackConfig(steps_back=2)).plan(bad_step=5, detected_at=7, common_steps=[4, 5, 6])
    assert plan.target is None and plan.escalate and "step 3" in plan.reason


def test_the_cap_counts_rollbacks_within_the_window_only() -> None:
    governor = RollbackGovernor(RollbackConfig(max_rollbacks=2, window_steps=100))
    governor.record(_record(10, 10))
    assert not governor.plan(50, 52, [50]).escalate
    governor.record(_record(50, 50))
    plan = governor.plan(90, 92, [90])  # two rollbacks in (-10, 90]: the third escalates
    assert plan.escalate and plan.target == 90 and "max_rollbacks=2" in plan.reason
    assert not governor.plan(140, 142, [140]).escalate  # step 10 left the window
    assert RollbackGovernor(RollbackConfig(max_rollbacks=0)).plan(3, 5, [3]).escalate


def test_at_the_cap_a_fault_that_came_back_at_its_step_with_other_batches_is_told_from_data() -> None:
    governor = RollbackGovernor(RollbackConfig(max_rollbacks=2))
    for _ in range(2):  # the same bad step twice, each time with its batch left out
        governor.record(dataclasses.replace(_record(46, 46), skipped={"1": [7]}))
    assert governor.plan(46, 48, [46]).recurs  # not the data: a restart elsewhere can help
    assert not governor.plan(47, 49, [47]).recurs  # another step
    kept = RollbackGovernor(RollbackConfig(max_rollbacks=2))
    for _ in range(2):  # the batch was trained on again each time: the data is not ruled out
        kept.record(_record(46, 46))
    assert kept.plan(46, 48, [46]).escalate and not kept.plan(46, 48, [46]).recurs
    assert not RollbackGovernor(RollbackConfig(max_rollbacks=0)).plan(3, 5, [3]).recurs  # no rollback to judge


def test_a_bad_step_after_its_detection_is_an_error() -> None:
    with pytest.raises(ValueError, match="after the step"):
        RollbackGovernor().plan(bad_step=8, detected_at=7, common_steps=[6])


def test_report_lists_rollbacks_and_the_escalation_apart() -> None:
    governor = RollbackGovernor()
    governor.record(_record(5, 5))
    governor.record(_record(9, 9, escalated=True))
    report = governor.report()
    assert [r["bad_step"] for r in report["rollbacks"]] == [5]
    assert report["escalated"]["bad_step"] == 9 and report["steps_lost"] == 4


def test_lr_cooldown_scales_only_inside_the_step_for_k_steps_and_leaves_the_schedule_alone() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    cooldown = LrCooldown(factor=0.1)
    cooldown.install([opt])
    cooldown.start(2)
    moves = []
    for _ in range(4):
        before = param.detach().clone()
        param.grad = torch.ones(1)
        opt.step()
        sched.step()
        moves.append(round(float(before - param.detach()), 6))
    # lr 1, 0.5, 0.25, 0.125 from the schedule; the first two steps at a tenth of it
    assert moves == [0.1, 0.05, 0.25, 0.125]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0625) and cooldown.remaining == 0
    cooldown.remove()


def test_quarantine_file_appends_whole_lines_and_skips_a_torn_one(tmp_path: Path) -> None:
    path = tmp_path / "run" / "quarantine.jsonl"
    append_quarantine(path, {"bad_step": 5, "skipped": {"0": [1, 2], "1": [7]}})
    append_quarantine(path, {"bad_step": 9, "skipped": {"1": [3]}})
    with open(path, "a") as f:
        f.write('{"bad_step": 1')  # a write cut short
    assert [r["bad_step"] for r in read_quarantine(path)] == [5, 9]
    assert quarantined_indices(path) == {1, 2, 3, 7}
    assert read_quarantine(tmp_path / "absent.jsonl") == []
    assert json.loads(path.read_text().splitlines()[0])["skipped"]["0"] == [1, 2]


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"steps_back": -1}, "steps_back"),
        ({"lr_cooldown_steps": -2}, "lr_cooldown_steps"),
        ({"lr_cooldown_factor": 0.0}, "lr_cooldown_factor"),
        ({"lr_cooldown_factor": 1.5}, "lr_cooldown_factor"),
        ({"max_rollbacks": -1}, "max_rollbacks"),
        ({"window_steps": 0}, "window_steps"),
        ({"quarantine_file": "a/b.jsonl"}, "quarantine_file"),
    ],
)
def test_config_errors_name_the_key(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"policy\.rollback\.{key} "):
        RollbackConfig(**kwargs)  # type: ignore[arg-type]


def test_policy_defaults_roll_back_nonfinite_in_process_and_only_log_spikes() -> None:
    config = PolicyConfig()
    assert config.nonfinite == "rollback_in_process" and config.spike == "log"
    with pytest.raises(ConfigError, match=r"policy\.spike must be one of"):
        PolicyConfig(spike="rollback")
    assert not Action.ROLLBACK_IN_PROCESS.stops
    assert Action.ALERT.severity < Action.ROLLBACK_IN_PROCESS.severity < Action.CHECKPOINT_AND_STOP.severity


def test_one_rank_asking_for_an_in_process_rollback_decides_it_for_all() -> None:
    # rank 1 saw a NaN, rank 0 nothing: the agreement (MAX) of their asks gives both ranks the rollback
    rank1, rank0 = PolicyBus(PolicyConfig()), PolicyBus(PolicyConfig())
    rank1.post(Verdict(Event.NONFINITE, 7, 1, "nan", bad_step=5))
    agreed = max(rank1.contribute(), rank0.contribute())
    decisions = [rank1.decide(7, agreed), rank0.decide(7, agreed)]
    for d in decisions:
        assert d is not None and (d.action, d.event) == (Action.ROLLBACK_IN_PROCESS, Event.NONFINITE)
        assert d.exit_code is ExitCode.OK  # the job goes on
    assert decisions[0] is not None and decisions[0].verdicts[0].bad_step == 5


def test_an_escalated_decision_carries_its_own_exit_code() -> None:
    stop = Decision(9, Action.CHECKPOINT_AND_STOP, Event.NONFINITE, code=ExitCode.DIVERGED)
    assert stop.exit_code is ExitCode.DIVERGED
    assert Decision(9, Action.ROLLBACK, Event.NONFINITE).exit_code is ExitCode.SDC
    assert Decision(9, Action.ROLLBACK_IN_PROCESS, Event.SPIKE, code=ExitCode.DIVERGED).exit_code is ExitCode.OK


def test_the_report_of_a_run_directory_lists_every_rollback_of_its_quarantine_file(tmp_path: Path) -> None:
    from lightning_resilience.report import ResilienceReport, explain
    from lightning_resilience.report.render import _detection_rows

    path = tmp_path / "resilience" / "quarantine.jsonl"
    append_quarantine(path, _record(5, 5).to_json() | {"skipped": {"0": [1, 2], "1": [3, 4]}, "seconds": 0.004})
    append_quarantine(path, _record(9, 9, escalated=True).to_json())
    report = explain(ResilienceReport(), tmp_path)
    assert [r["bad_step"] for r in report.sections["rollback"]["rollbacks"]] == [5]
    assert report.sections["rollback"]["escalated"]["bad_step"] == 9
    rows = [v for k, v in _detection_rows(report.sections) if k == "in-process rollback"]
    assert (
        rows[0] == "step 7 (nonfinite, bad step 5): restored step 5 in 4.00 ms, 2 step(s) lost, 4 sample(s) quarantined"
    )
    assert rows[1].endswith("escalated, job stopped")


def test_the_state_a_verdict_allows_to_restore() -> None:
    from lightning_resilience.lightning.rollback import _bad_step

    assert _bad_step(Verdict(Event.NONFINITE, 9, 0, "nan", bad_step=7)) == 7
    assert _bad_step(Verdict(Event.SPIKE, 9, 0, "spike")) == 9  # a detector that names no bad step: its own step
    # a corrupt update found by a reconciliation: at most the newest verified step (none: the start)
    assert _bad_step(Verdict(Event.SDC_MISMATCH, 9, 0, "diverged", verified_step=5)) == 5
    assert _bad_step(Verdict(Event.SDC_MISMATCH, 9, 0, "diverged")) == 0
