"""The cost budget sets the cadences: the cadence function, and the engine choosing with it from what it measures.

The engine tests drive a real :class:`CheckpointManager`. In the deterministic ones its clock is a counter that
training steps move forward by a fixed step time and that capturing the state moves forward in proportion to the
state's bytes (a heavier state costs more); the last test uses real tensors and the real clock.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilience.checkpoint.cadence_plan import TierCosts, plan_cadences
from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.intervals import daly_interval, estimate_mtbf
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.tier import BUDGET

STEP_S = 0.100
BUDGET_FRACTION = 0.02


# ------------------------------------------------------------------------------------------- the cadence function
def test_a_snapshot_within_the_budget_is_taken_every_step() -> None:
    (ram,) = plan_cadences([TierCosts("memory", False, 0.001)], step_s=STEP_S, budget=0.02, mtbf_s=3600)
    assert (ram.every_n_steps, ram.set_by) == (1, "budget") and ram.overhead == pytest.approx(0.01)
    assert "within" in ram.reason and "every step" in ram.reason


def test_a_snapshot_over_the_budget_is_taken_every_k_steps_within_it() -> None:
    (ram,) = plan_cadences([TierCosts("memory", False, 0.015)], step_s=STEP_S, budget=0.02, mtbf_s=3600)
    assert ram.every_n_steps == 8  # 15% of a step: the smallest k with 15% / k <= 2%
    assert ram.overhead <= 0.02 and "over its 2.00% of the budget, so every 8 steps" in ram.reason


def test_persistent_tiers_follow_daly_and_never_outrun_their_writes() -> None:
    mtbf = 8 * 3600.0
    daly, write = plan_cadences(
        [TierCosts("local", True, 0.010, write_s=0.5), TierCosts("remote", True, 0.010, write_s=300.0)],
        step_s=STEP_S,
        budget=0.02,
        mtbf_s=mtbf,
    )
    assert daly.set_by == "daly" and daly.every_n_steps == round(daly_interval(0.010, mtbf) / STEP_S)
    assert write.set_by == "write" and write.every_n_steps == 3000 and "waits for it" in write.reason


def test_persistent_tiers_share_half_the_budget() -> None:
    (local,) = plan_cadences([TierCosts("local", True, 2.0)], step_s=STEP_S, budget=0.02, mtbf_s=3600.0)
    assert local.set_by == "budget" and local.overhead <= 0.01  # Daly alone: every ~1250 steps, 1.6%


def test_fixed_tiers_keep_their_cadence_and_take_their_share_first() -> None:
    local, ram = plan_cadences(
        [TierCosts("local", True, 0.010, every_n_steps=1), TierCosts("memory", False, 0.001)],
        step_s=STEP_S,
        budget=0.02,
        mtbf_s=3600.0,
    )
    assert (local.every_n_steps, local.set_by) == (1, "config")  # 10% on its own: over the budget, still kept
    assert ram.every_n_steps == 10 and "the other tiers take 10.00%" in ram.reason  # the floor share: 0.1%


def test_the_detectors_take_their_cost_from_the_budget_first() -> None:
    """One budget for the suite: a snapshot that fits 2% alone (1%) is spaced out when the detectors take 1.5%."""
    (alone,) = plan_cadences([TierCosts("memory", False, 0.001)], step_s=STEP_S, budget=0.02, mtbf_s=3600)
    (ram,) = plan_cadences([TierCosts("memory", False, 0.001)], step_s=STEP_S, budget=0.02, mtbf_s=3600,
                           detectors=0.015)  # fmt: skip
    assert alone.every_n_steps == 1
    assert ram.every_n_steps == 2 and ram.overhead + 0.015 <= 0.02
    assert "over its 0.50% of the budget" in ram.reason and "the detectors take 1.50%" in ram.reason
    (starved,) = plan_cadences([TierCosts("memory", False, 0.001)], step_s=STEP_S, budget=0.02, mtbf_s=3600,
                               detectors=0.05)  # fmt: skip
    assert starved.every_n_steps == 10  # detectors over the budget: the tiers keep the floor share (0.1%)
    (fixed,) = plan_cadences([TierCosts("memory", False, 0.001, every_n_steps=1)], step_s=STEP_S, budget=0.02,
                             mtbf_s=3600, detectors=0.05)  # fmt: skip
    assert (fixed.every_n_steps, fixed.set_by) == (1, "config")
    with pytest.raises(ValueError, match="detectors"):
        plan_cadences([], step_s=1.0, budget=0.02, mtbf_s=1.0, detectors=-0.1)


def test_the_prior_gives_way_to_the_runs_own_failures() -> None:
    assert estimate_mtbf(8 * 3600.0) == 8 * 3600.0
    assert estimate_mtbf(8 * 3600.0, observed_s=40 * 3600.0, failures=11) == pytest.approx(4 * 3600.0)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="budget"):
        plan_cadences([], step_s=1.0, budget=0.0, mtbf_s=1.0)
    with pytest.raises(ValueError, match="step_s"):
        plan_cadences([], step_s=0.0, budget=0.02, mtbf_s=1.0)


# ------------------------------------------------------------------------------------------------------ the engine
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _state(numel: int) -> dict[str, Any]:
    return {"model": {"w": torch.zeros(numel)}, "step": 0}


def _train(
    manager: CheckpointManager, clock: FakeClock, state: dict[str, Any], steps: range, seconds_per_byte: float
) -> tuple[float, float]:
    """Steps of STEP_S; capturing ``state`` costs its bytes x ``seconds_per_byte``. Returns the blocked seconds
    and the compute seconds of these steps."""
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())

    def capture() -> dict[str, Any]:
        clock.now += nbytes * seconds_per_byte
        return state

    blocked = 0.0
    for step in steps:
        clock.now += STEP_S
        before = clock.now
        manager.on_step(step, capture)
        blocked += clock.now - before
    return blocked, STEP_S * len(steps)


def _manager(managers: list[CheckpointManager], *tiers: Any, **config: Any) -> CheckpointManager:
    clock = config.pop("clock")
    manager = CheckpointManager(list(tiers), CheckpointConfig(**config), clock=clock)
    manager.setup()
    managers.append(manager)
    return manager


@pytest.mark.parametrize("numel", [2**12, 2**18])
def test_a_heavier_state_moves_the_snapshot_to_every_k_steps_within_the_budget(
    numel: int, managers: list[CheckpointManager]
) -> None:
    """At 14 ms per MB, a 16 KiB state costs 0.2% of a 100 ms step (every step); a 1 MiB one costs 15%, over the 2%
    budget: the engine moves to every k steps on its own and the cost it then has lands within the budget (+-25%)."""
    clock = FakeClock()
    manager = _manager(
        managers, MemoryTier(every_n_steps=BUDGET, keep=2), clock=clock, overhead_budget=BUDGET_FRACTION,
        cadence_review_steps=20,
    )  # fmt: skip
    state = _state(numel)
    _train(manager, clock, state, range(1, 41), 1.4e-8)
    blocked, compute = _train(manager, clock, state, range(41, 201), 1.4e-8)
    report = manager.cadence.report()
    chosen = report["tiers"]["memory"]
    if numel == 2**12:  # ~0.02%: every step
        assert chosen["every_n_steps"] == 1 and manager.stats.captures == 200
        return
    cost = numel * 4 * 1.4e-8 / STEP_S
    assert cost > 5 * BUDGET_FRACTION
    assert chosen["every_n_steps"] > 1 and chosen["set_by"] == "budget"
    assert "over its 2.00% of the budget" in chosen["reason"]
    assert report["changes"][0]["step"] == 9 and report["changes"][0]["every_n_steps"] == chosen["every_n_steps"]
    assert 0.75 * BUDGET_FRACTION <= blocked / compute <= 1.25 * BUDGET_FRACTION
    assert manager.memory_steps()[-1] % chosen["every_n_steps"] == 0


def test_the_engine_leaves_the_tiers_what_the_detectors_do_not_take(managers: list[CheckpointManager]) -> None:
    """A 256 KiB state costs 3.7% of a step: every 2 steps alone. With detectors spending 1.5% of every step on the
    training thread (counted as they run), the engine spaces snapshots to every 8, and the suite's whole cost (the
    detectors' and the snapshots') lands within the budget (+-25%)."""
    chosen, cost = {}, {}
    for detectors in (0.0, 0.015):
        clock = FakeClock()
        manager = _manager(
            managers, MemoryTier(every_n_steps=BUDGET, keep=2), clock=clock, overhead_budget=BUDGET_FRACTION,
            cadence_review_steps=20,
        )  # fmt: skip
        calls = [0]
        manager.cadence.count_detectors(lambda calls=calls, per_step=detectors * STEP_S: calls[0] * per_step)
        state, blocked, compute = _state(2**16), 0.0, 0.0
        for step in range(1, 201):
            calls[0] += 1  # the detectors' work of this step
            b, c = _train(manager, clock, state, range(step, step + 1), 1.4e-8)
            if step > 40:  # past the first choices
                blocked, compute = blocked + b, compute + c
        report = manager.cadence.report()
        chosen[detectors], cost[detectors] = report["tiers"]["memory"], blocked / compute + detectors
        assert report["measured"]["detectors_s"] == pytest.approx(detectors * STEP_S, abs=1e-6)
    assert chosen[0.0]["every_n_steps"] == 2
    assert chosen[0.015]["every_n_steps"] == 8 and "the detectors take 1.50%" in chosen[0.015]["reason"]
    assert 0.75 * BUDGET_FRACTION <= cost[0.015] <= 1.25 * BUDGET_FRACTION, cost


def test_explicit_cadences_are_never_overridden(tmp_path: Path, managers: list[CheckpointManager]) -> None:
    """A state costing 3x the step: the budget would space every tier out, but cadences set in the config hold,
    beside a tier the budget decides."""
    clock = FakeClock()
    manager = _manager(
        managers,
        MemoryTier(every_n_steps=1, keep=2),
        LocalTier(tmp_path / "a", every_n_steps=3, keep=2, name="fixed"),
        LocalTier(tmp_path / "b", every_n_steps=BUDGET, keep=2, name="budgeted"),
        clock=clock, overhead_budget=0.01, cadence_review_steps=5,
    )  # fmt: skip
    state = _state(2**14)

    def capture() -> dict[str, Any]:
        clock.now += 0.3
        return state

    for step in range(1, 61):
        clock.now += STEP_S
        manager.on_step(step, capture)
        assert manager.wait()
    assert manager.stats.captures >= 60 and manager.memory_steps() == [59, 60]
    assert manager.stats.tiers["fixed"].writes == 20  # steps 3, 6, ..., 60
    assert manager.cadence.every("memory") == 1 and manager.cadence.every("fixed") == 3
    report = manager.cadence.report()["tiers"]
    assert report["memory"]["set_by"] == report["fixed"]["set_by"] == "config"
    assert report["budgeted"]["set_by"] != "config" and report["budgeted"]["every_n_steps"] > 3


def test_no_agreement_runs_when_no_tier_is_left_to_the_budget(managers: list[CheckpointManager]) -> None:
    manager = _manager(managers, MemoryTier(every_n_steps=2, keep=2), clock=FakeClock(), cadence_review_steps=1)

    def refuse(*_: Any, **__: Any) -> list[int]:
        raise AssertionError("a cadence review ran")

    manager.cadence.bind(refuse, 0)
    for step in range(1, 30):
        manager.on_step(step, lambda: _state(16))
    assert manager.memory_steps() == [26, 28] and manager.cadence.report()["changes"] == []


def test_a_tier_left_to_the_budget_is_valid_config_and_a_negative_one_is_not(tmp_path: Path) -> None:
    assert LocalTier(tmp_path, every_n_steps=0).every_n_steps == BUDGET
    with pytest.raises(ValueError, match=r"tiers.local.every_n_steps must be >= 1, or 0 \(the cost budget"):
        LocalTier(tmp_path, every_n_steps=-1)
    with pytest.raises(ValueError, match=r"checkpoint\.overhead_budget must be in"):
        CheckpointConfig(overhead_budget=1.5)


def test_a_real_heavy_state_is_spaced_out_by_the_engine(managers: list[CheckpointManager]) -> None:
    """Real tensors, the real clock: a 64 MiB state against a ~20 ms step of small matmuls, a snapshot of it costing
    25-100% of the step. The engine measures it, moves to every k steps, and what it then costs (the training
    thread's own time in ``on_step``, and what the steps after a snapshot take beyond the others: the copy leaves
    the caches cold) lands near the 3% budget (within half as much again: a real clock on a shared machine), and not
    far under it."""
    budget = 0.03
    manager = CheckpointManager(
        [MemoryTier(every_n_steps=BUDGET, keep=2)], CheckpointConfig(overhead_budget=budget, cadence_review_steps=10)
    )
    manager.setup()
    managers.append(manager)
    state = {"model": {"w": torch.randn(16 * 2**20)}}
    a = torch.randn(384, 384)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    blocked, clean, after, taken = 0.0, [], [], False
    try:
        for step in range(1, 301):
            t0 = time.perf_counter()
            x = a
            for _ in range(12):
                x = torch.tanh(x @ a)
            t1 = time.perf_counter()
            before = manager.stats.capture_seconds
            if step > 100:
                (after if taken else clean).append(t1 - t0)
            taken = manager.on_step(step, lambda: state)
            if step > 100:
                blocked += manager.stats.capture_seconds - before
    finally:
        torch.set_num_threads(threads)
    chosen = manager.cadence.report()["tiers"]["memory"]
    assert chosen["every_n_steps"] > 1 and "over its 3.00% of the budget" in chosen["reason"], chosen
    step_s = statistics.fmean(clean)
    cost = blocked + max(sum(after) - len(after) * step_s, 0.0)
    # the engine's own estimate of what it chose fits the budget
    assert chosen["overhead"] <= budget, chosen
    # what it cost on the real clock: near the budget, not far under it (the noise of real steps spaces the snapshots
    # out at times) and not far over it (on a shared machine a snapshot's copy can take half as long again as the
    # ones the engine measured: seen at 4.0% of a 3% budget)
    assert 0.5 * budget <= cost / (step_s * (len(clean) + len(after))) <= 1.5 * budget, (cost, step_s, chosen)


def test_the_simulator_chooses_as_the_engine_does(managers: list[CheckpointManager]) -> None:
    """The same measured costs give the same cadence in the engine (what it measured) and in the simulator (what
    its tier is configured to cost): one cadence function."""
    from lightning_resilience.sim.config import JobConfig, SimConfig, SimTierConfig

    clock = FakeClock()
    manager = _manager(managers, MemoryTier(every_n_steps=BUDGET, keep=2), clock=clock, cadence_review_steps=10)
    state = _state(2**16)
    _train(manager, clock, state, range(1, 30), 0.015 / (2**16 * 4))  # a snapshot costs 15 ms of a 100 ms step
    engine = manager.cadence.plan["memory"]
    sim = SimConfig(
        tiers=[SimTierConfig(name="memory", every_n_steps=BUDGET, blocking_s=0.015, durability="process")],
        job=JobConfig(step_s=STEP_S),
    )
    (simulated,) = sim.cadences()
    assert (simulated.every_n_steps, simulated.set_by) == (engine.every_n_steps, engine.set_by) == (8, "budget")


def test_what_a_snapshot_slows_the_next_step_by_is_counted(managers: list[CheckpointManager]) -> None:
    """A snapshot blocks 4 ms of a 100 ms step and its background copy slows the step after it by 8 ms. By its
    blocking alone every 2 steps would fit the 2% budget, but each snapshot costs the user 12 ms: the engine measures
    the steps after a snapshot against the steps nothing touched, spaces snapshots to every 6 steps, and their whole
    cost (blocking and slower steps) lands within the budget (+-25%)."""
    clock = FakeClock()
    manager = _manager(
        managers, MemoryTier(every_n_steps=BUDGET, keep=2), clock=clock, overhead_budget=BUDGET_FRACTION,
        cadence_review_steps=20,
    )  # fmt: skip
    state = _state(16)

    def capture() -> dict[str, Any]:
        clock.now += 0.004
        return state

    taken, cost, compute, spacings = False, 0.0, 0.0, []
    for step in range(1, 401):
        slow = 0.008 if taken else 0.0  # the background copy of the last snapshot drags this step
        clock.now += STEP_S + slow
        before = clock.now
        taken = manager.on_step(step, capture)
        spacings.append(manager.cadence.every("memory"))
        if step > 200:
            cost, compute = cost + slow + (clock.now - before), compute + STEP_S
    report = manager.cadence.report()
    chosen = report["tiers"]["memory"]
    assert spacings[10] == 2  # the first choice: the blocking alone (every step had a snapshot, nothing to compare)
    assert chosen["every_n_steps"] == 6 and chosen["set_by"] == "budget", chosen
    assert report["measured"]["snapshot_background_s"] == pytest.approx(0.008, abs=1e-6)
    assert "a snapshot blocks 4.0 ms and slows the next step by 8.0 ms, 12.00% of a 100.0 ms step" in chosen["reason"]
    assert 0.75 * BUDGET_FRACTION <= cost / compute <= 1.25 * BUDGET_FRACTION, cost / compute


def test_a_snapshot_that_slows_nothing_is_charged_its_blocking_alone(managers: list[CheckpointManager]) -> None:
    """Steps after a snapshot as fast as the others: nothing is added to its blocking, and the reason says so."""
    clock = FakeClock()
    manager = _manager(
        managers, MemoryTier(every_n_steps=BUDGET, keep=2), clock=clock, overhead_budget=BUDGET_FRACTION,
        cadence_review_steps=20,
    )  # fmt: skip
    _train(manager, clock, _state(2**16), range(1, 201), 0.004 / (2**16 * 4))
    report = manager.cadence.report()
    assert report["measured"]["snapshot_background_s"] == 0.0
    assert report["tiers"]["memory"]["every_n_steps"] == 2
    assert "slows" not in report["tiers"]["memory"]["reason"]
