"""The fault kit: faults fire where, when and as often as planned; tiers and collectives consult it; a subprocess
rebuilds a plan from the environment."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest

from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.tier import TierIdentity
from lightning_resilience.collective import SideGroup
from lightning_resilience.testing.faults import ENV, Fault, FaultPlan, InjectedError, InjectedFault, arm_from_env
from tests.checkpoint.conftest import make_snapshot


def test_a_fault_fires_at_its_rank_step_and_operation_as_often_as_planned() -> None:
    plan = FaultPlan().fail_at(1, 4, "tier.*.write", times=2).fail_at(None, None, "policy.decide", "error")
    plan.check("tier.local.write", rank=0, step=4)  # another rank
    plan.check("tier.local.write", rank=1, step=3)  # another step
    plan.check("tier.local.read", rank=1, step=4)  # another operation
    for _ in range(2):
        with pytest.raises(InjectedFault, match=r"tier\.local\.write \(rank 1, step 4\)"):
            plan.check("tier.local.write", rank=1, step=4)
    plan.check("tier.local.write", rank=1, step=4)  # used up
    with pytest.raises(InjectedError):
        plan.check("policy.decide", rank=3, step=None)
    assert [(f.operation, f.rank, f.step) for f in plan.fired][:2] == [("tier.local.write", 1, 4)] * 2
    with pytest.raises(ValueError, match="action"):
        Fault("x", action="explode")


def test_instrumented_tier_and_internal_points(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path, every_n_steps=1, keep=3)
    plan = FaultPlan().fail_at(0, 2, "tier.local.write").fail_at(0, 3, "local.write_shard", "error")
    assert plan.instrument(tier) is tier and isinstance(tier, LocalTier)
    tier.bind(TierIdentity())
    tier.write(make_snapshot(1))
    with pytest.raises(InjectedFault):
        tier.write(make_snapshot(2))
    tier.write(make_snapshot(3))  # the internal point is patched only while armed
    with plan.armed(), pytest.raises(InjectedError):
        tier.write(make_snapshot(3))  # a rewrite of step 3 reaches the shard writer: armed now
    assert tier.list_steps() == [1, 3]


def test_an_armed_plan_reaches_the_side_groups() -> None:
    plan = FaultPlan().fail_at(0, 7, "checkpoint.agree")
    group = SideGroup("test", timedelta(seconds=5))
    assert group.all_true(True, op="checkpoint.agree", step=7)  # not armed
    with plan.armed(), pytest.raises(InjectedFault):
        group.all_true(True, op="checkpoint.agree", step=7)
    assert group.all_true(True, op="checkpoint.agree", step=7)  # disarmed again


def test_a_hang_blocks_until_released() -> None:
    plan = FaultPlan().fail_at(None, None, "peer.exchange", "hang")
    done = threading.Event()
    thread = threading.Thread(target=lambda: (plan.check("peer.exchange", rank=0), done.set()), daemon=True)
    thread.start()
    assert plan.hanging.wait(10) and not done.is_set()
    plan.release()
    assert done.wait(10)
    with pytest.raises(InjectedFault, match="never released"):
        FaultPlan(hang_limit=timedelta(seconds=0.05)).fail_at(None, None, "x", "hang").check("x", rank=0)


def test_a_plan_travels_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = FaultPlan().fail_at(1, 8, "tier.local.write").fail_at(0, None, "checkpoint.*", "delay", seconds=0.5)
    again = FaultPlan.from_env(plan.to_env())
    assert again is not None and again.faults == plan.faults
    monkeypatch.delenv(ENV, raising=False)
    assert arm_from_env() is None
    with pytest.raises(ValueError, match=ENV):
        FaultPlan.from_env("[{'not': json}]")
