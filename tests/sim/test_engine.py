"""The event engine on tiny deterministic cases: every expected figure is worked out by hand in the comments."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from lightning_resilience.sim import CATEGORIES, FailureTrace, simulate, simulate_many
from lightning_resilience.sim.config import (
    ClusterConfig,
    FailureConfig,
    FailureKindConfig,
    JobConfig,
    SimConfig,
    SimTierConfig,
    default_failure_kinds,
)
from tests.sim._configs import kinds, tiny

NO_FAILURES = FailureTrace.of([])


def _check_total(result) -> None:  # type: ignore[no-untyped-def]
    assert math.isclose(result.breakdown.total, result.wall_s, rel_tol=1e-9, abs_tol=1e-6)
    assert all(getattr(result.breakdown, c) >= -1e-9 for c in CATEGORIES)


def test_no_failures_ettr_is_one_minus_checkpoint_overhead() -> None:
    # every 10 steps of 1 s the loop stops 1 s: 100 cycles of 11 s in 1100 s
    cfg = tiny([SimTierConfig(name="disk", every_n_steps=10, blocking_s=1.0)], horizon=1100.0)
    r = simulate(cfg, trace=NO_FAILURES)
    assert r.final_step == 1000
    assert r.breakdown.checkpoint == pytest.approx(100.0)
    assert r.ettr == pytest.approx(1 - 1 / 11)
    assert r.breakdown.lost == 0 and r.breakdown.restart == 0
    _check_total(r)


def test_no_failures_two_tiers_sharing_steps_add_their_blocking() -> None:
    # steps 1..40: tier a blocks 0.5 s at 10, 20, 30, 40; tier b blocks 2 s at 20, 40 -> 6 s of blocking
    tiers = [
        SimTierConfig(name="a", every_n_steps=10, blocking_s=0.5),
        SimTierConfig(name="b", every_n_steps=20, blocking_s=2.0),
    ]
    r = simulate(tiny(tiers, horizon=46.0), trace=NO_FAILURES)
    assert r.final_step == 40
    assert r.breakdown.checkpoint == pytest.approx(6.0)
    assert r.ettr == pytest.approx(40 / 46)


def test_known_crash_sequence_gives_exact_lost_work() -> None:
    # crash at 25.5 s: 25 steps done, checkpoint at step 20 -> 5 steps + 0.5 s of a partial step lost.
    # detection 2 s, in_job restart 3 s, restore 5 s -> training resumes at 35.5 s from step 20, then runs
    # 64.5 s to the horizon: 64 more steps (final step 84) and another 0.5 s partial step.
    cfg = tiny(failure_kinds=kinds(crash=dict(detection_s=2.0)))
    r = simulate(cfg, trace=FailureTrace.of([(25.5, "crash")]))
    assert r.final_step == 84
    assert r.breakdown.productive == pytest.approx(84.0)
    assert r.breakdown.lost == pytest.approx(5.5 + 0.5)
    assert (r.breakdown.detection, r.breakdown.restart, r.breakdown.restore) == pytest.approx((2.0, 3.0, 5.0))
    assert r.failures["crash"] == 1 and r.restarts["in_job"] == 1 and r.restores["disk"] == 1
    _check_total(r)


def test_checkpoint_still_being_written_at_the_crash_is_not_used() -> None:
    # the step-20 checkpoint commits at 20 + 6 = 26 s, after the crash at 25.5 s: restore from step 10 instead
    cfg = tiny([SimTierConfig(name="disk", every_n_steps=10, write_s=6.0, restore_s=5.0)])
    r = simulate(cfg, trace=FailureTrace.of([(25.5, "crash")]))
    assert r.breakdown.lost == pytest.approx(15.5 + 0.5)  # steps 11..25 + partial, then the horizon's partial
    # resumed at 25.5 + 3 + 5 = 33.5 s from step 10: 66 steps to the horizon
    assert r.final_step == 76
    _check_total(r)


def test_hang_lets_writes_in_flight_commit_before_detection() -> None:
    # same write as above, but a hang: the job stalls, the background write commits at 26 s < 25.5 + 10
    cfg = tiny(
        [SimTierConfig(name="disk", every_n_steps=10, write_s=6.0, restore_s=5.0)],
        failure_kinds=kinds(hang=dict(detection_s=10.0)),
    )
    r = simulate(cfg, trace=FailureTrace.of([(25.5, "hang")]))
    assert r.breakdown.detection == pytest.approx(10.0)
    # resumes at 25.5 + 10 + 3 + 5 = 43.5 s from step 20: 56 steps to the horizon
    assert r.final_step == 76
    assert r.breakdown.lost == pytest.approx(5.5 + 0.5)


def test_checkpoint_interrupted_mid_block_is_not_taken() -> None:
    # 2 s blocks: step 10 ends at 10 s (block to 12 s), step 20 at 22 s; a crash at 23 s interrupts the block of
    # step 20: 1 s is billed to checkpointing and step 10 is the newest checkpoint
    cfg = tiny([SimTierConfig(name="disk", every_n_steps=10, blocking_s=2.0, restore_s=0.0)], horizon=60.0)
    r = simulate(cfg, trace=FailureTrace.of([(23.0, "crash")]))
    assert r.restores["disk"] == 1
    # 2 s (step 10) + 1 s (half of step 20's block) before the crash; after resuming at 26 s from step 10:
    # steps 11..20 (10 s), block 2 s, steps 21..30, block 2 s, then 10 s of steps to 60 s -> final step 40
    assert r.final_step == 40
    assert r.breakdown.checkpoint == pytest.approx(2.0 + 1.0 + 2.0 + 2.0)
    _check_total(r)


@pytest.mark.parametrize(
    ("durability", "node_lost", "restart", "restored_from"),
    [
        ("process", False, "in_process", "fast"),  # the processes survive: even process RAM is there
        ("process", False, "in_job", "slow"),  # respawned processes lose process RAM
        ("host", False, "in_job", "fast"),  # host RAM / local disk survive a process restart
        ("host", True, "in_job", "slow"),  # ... not a node loss
        ("peer", True, "in_job", "fast"),  # a peer copy survives a single node loss
    ],
)
def test_tier_survival_by_loss_scope(durability: str, node_lost: bool, restart: str, restored_from: str) -> None:
    tiers = [
        SimTierConfig(name="fast", every_n_steps=5, restore_s=1.0, durability=durability),  # type: ignore[arg-type]
        SimTierConfig(name="slow", every_n_steps=20, restore_s=7.0, durability="remote"),
    ]
    cfg = tiny(tiers, failure_kinds=kinds(crash=dict(node_lost=node_lost, restart=restart)))
    r = simulate(cfg, trace=FailureTrace.of([(27.5, "crash")]))
    assert r.restores[restored_from] == 1
    restored_step = 25 if restored_from == "fast" else 20
    assert r.breakdown.lost >= (27 - restored_step) + 0.5
    expected_path = "cold" if node_lost else restart
    assert r.restarts[expected_path] == 1


def test_warm_spare_is_used_then_refilled_and_cold_restart_without_one() -> None:
    cfg = tiny(failure_kinds=kinds(crash=dict(node_lost=True)), spares=1, horizon=200.0)
    # spare refill takes 50 s: the second loss (at 40 s) finds none, the third (at 120 s) finds the refilled one
    r = simulate(cfg, trace=FailureTrace.of([(10.5, "crash", 0), (40.5, "crash", 2), (120.5, "crash", 1)]))
    assert r.restarts["warm_spare"] == 2 and r.restarts["cold"] == 1
    assert r.breakdown.restart == pytest.approx(4.0 + 20.0 + 4.0)


def test_peer_tier_is_lost_when_neighbouring_nodes_fail_in_one_recovery() -> None:
    tiers = [
        SimTierConfig(name="peer", every_n_steps=5, restore_s=1.0, durability="peer"),
        SimTierConfig(name="remote", every_n_steps=20, restore_s=7.0),
    ]
    kinds_lost = kinds(crash=dict(node_lost=True))
    # node 1 fails at 27.5 s, its ring neighbour node 2 during the 20 s cold restart: the peer copy is gone
    neighbours = simulate(
        tiny(tiers, failure_kinds=kinds_lost), trace=FailureTrace.of([(27.5, "crash", 1), (30.0, "crash", 2)])
    )
    assert neighbours.restores == {"peer": 0, "remote": 1, "scratch": 0}
    # node 3 is no neighbour of node 1 among 8 nodes: the peer copy of step 25 survives
    far = simulate(
        tiny(tiers, failure_kinds=kinds_lost, nodes=8), trace=FailureTrace.of([(27.5, "crash", 1), (30.0, "crash", 4)])
    )
    assert far.restores == {"peer": 1, "remote": 0, "scratch": 0}


def test_crash_during_recovery_restarts_the_recovery() -> None:
    # first crash at 25.5 s (restart 3 s, restore 5 s); the second at 27 s, 1.5 s into the restart
    r = simulate(tiny(), trace=FailureTrace.of([(25.5, "crash"), (27.0, "crash")]))
    assert r.failures["crash"] == 2 and r.restarts["in_job"] == 2 and r.restores["disk"] == 1
    assert r.breakdown.restart == pytest.approx(1.5 + 3.0)
    assert r.breakdown.restore == pytest.approx(5.0)
    # resumes at 27 + 8 = 35 s from step 20 -> 65 steps to the horizon
    assert r.final_step == 85
    _check_total(r)


def test_sdc_discards_work_and_checkpoints_after_the_fault() -> None:
    # SDC at 12.5 s (step 12 clean), detected 20 s later at 32.5 s: checkpoints 20 and 30 are corrupt, restore 10
    tiers = [SimTierConfig(name="disk", every_n_steps=10, restore_s=5.0, keep=4)]
    r = simulate(tiny(tiers, failure_kinds=kinds(sdc=dict(detection_s=20.0))), trace=FailureTrace.of([(12.5, "sdc")]))
    assert r.restores["disk"] == 1
    # 32 steps computed, 22 of them lost (+0.5 s partial); resume at 32.5 + 3 + 5 = 40.5 from 10: 59 steps more
    assert r.final_step == 69
    assert r.breakdown.lost == pytest.approx(22.5 + 0.5)
    assert r.breakdown.detection == 0.0
    _check_total(r)


def test_sdc_without_an_older_checkpoint_restarts_from_scratch() -> None:
    tiers = [SimTierConfig(name="disk", every_n_steps=10, restore_s=5.0, keep=1)]
    r = simulate(tiny(tiers, failure_kinds=kinds(sdc=dict(detection_s=20.0))), trace=FailureTrace.of([(12.5, "sdc")]))
    # keep=1: only step 30 was held when the SDC was found, and it is corrupt
    assert r.restores == {"disk": 0, "scratch": 1}


def test_fail_slow_bills_extra_step_time_as_degraded() -> None:
    # slow from 10 s for 20 s at 1.5 s a step: 13 steps (19.5 s) + 0.5 s partial; then a restart
    r = simulate(
        tiny(failure_kinds=kinds(fail_slow=dict(detection_s=20.0))), trace=FailureTrace.of([(10.0, "fail_slow")])
    )
    assert r.breakdown.degraded == pytest.approx(13 * 0.5)
    # reached step 23 at 29.5 s, restore step 20; resume at 30 + 8 = 38 s -> 62 steps: final 82
    assert r.final_step == 82
    _check_total(r)


def test_target_steps_ends_the_job_when_reached() -> None:
    r = simulate(tiny(horizon=1e6, target_steps=50), trace=FailureTrace.of([(25.5, "crash")]))
    assert r.final_step == 50
    # 25.5 s, then 8 s down, then 30 steps from step 20
    assert r.wall_s == pytest.approx(25.5 + 8.0 + 30.0)
    assert r.ettr == pytest.approx(50 / 63.5)
    _check_total(r)


def test_no_tiers_every_failure_restarts_from_step_zero() -> None:
    r = simulate(tiny([]), trace=FailureTrace.of([(30.5, "crash")]))
    assert r.restores == {"scratch": 1}
    assert r.final_step == 100 - 30 - 3 - 1  # 66.5 s left after the 3 s restart: 66 steps, 0.5 s partial
    assert r.breakdown.lost == pytest.approx(31.0)


def test_slow_writes_defer_the_next_checkpoint() -> None:
    # every 5 steps but each write takes 12 s: the engine checkpoints every 15 steps instead
    cfg = tiny([SimTierConfig(name="disk", every_n_steps=5, write_s=12.0, blocking_s=1.0)], horizon=64.0)
    r = simulate(cfg, trace=NO_FAILURES)
    assert r.breakdown.checkpoint == pytest.approx(4.0)  # at steps 15, 30, 45, 60


@pytest.mark.parametrize("seed", range(4))
def test_breakdown_always_sums_to_wall_time(seed: int) -> None:
    cfg = SimConfig(
        cluster=ClusterConfig(gpus=2048, spare_nodes=2),
        failures=FailureConfig(mttf_s=3600.0, ref_gpus=1024, kinds=default_failure_kinds()),
        job=JobConfig(horizon_s=5 * 86400.0, step_s=3.0, seed=seed),
    )
    r = simulate(cfg)
    assert sum(r.failures.values()) > 50
    _check_total(r)
    assert 0 < r.ettr < 1


def test_replications_use_distinct_seeds_and_report_spread() -> None:
    cfg = SimConfig(job=JobConfig(horizon_s=10 * 86400.0))
    mc = simulate_many(cfg, 4)
    assert [r.seed for r in mc.runs] == [0, 1, 2, 3]
    assert len(set(mc.ettrs.tolist())) == 4
    assert mc.ettr_stderr > 0
    assert mc.ettrs.min() <= mc.ettr_mean <= mc.ettrs.max()


def test_trace_with_unconfigured_kind_is_rejected() -> None:
    cfg = tiny(failure_kinds=[FailureKindConfig(name="crash", fraction=1.0)])
    with pytest.raises(ValueError, match="does not configure"):
        simulate(cfg, trace=FailureTrace.of([(1.0, "hang")]))
    with pytest.raises(ValueError, match="sorted"):
        FailureTrace(times=np.array([2.0, 1.0]), kinds=("crash", "crash"), nodes=np.array([0, 0]))


def test_the_suite_bills_its_fixed_cost_and_a_round_that_outlasts_the_step() -> None:
    """Every step pays the suite's fixed cost; the agreement's round costs nothing until it outlasts the step."""
    from lightning_resilience.sim.step_cost import SuiteCostConfig

    cheap = dataclasses.replace(tiny(tiers=[]), suite=SuiteCostConfig(fixed_s=0.01, hop_s=20e-6))
    r = simulate(cheap)
    _check_total(r)
    assert r.breakdown.suite == pytest.approx(r.final_step * 0.01)
    assert r.breakdown.productive == pytest.approx(r.final_step * 1.0)
    suite = SuiteCostConfig(fixed_s=0.002, hop_s=20e-6)
    assert suite.round_s(16384) == pytest.approx(2 * 7 * 20e-6)  # 4-ary: 7 levels below rank 0
    assert suite.per_step_s(16384, 1.0) == pytest.approx(0.002)  # hidden by the step
    assert suite.per_step_s(16384, 1e-4) == pytest.approx(0.002 + 2 * 7 * 20e-6 - 1e-4)
    with pytest.raises(ValueError, match=r"suite\.fanout"):
        SuiteCostConfig(fanout=1)
