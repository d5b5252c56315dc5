"""SDC verification under DDP on real gloo ranks (plain torch loop, torch.multiprocessing): local gradients are
fingerprinted before the all-reduce, a corrupt contribution is named and recomputed so the run ends bitwise equal
to a clean one, replicas that diverge are named by a majority of three ranks and by nobody with two (inconclusive),
and a faulty device is named persistent by three ranks and by nobody with two."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilience.collective import set_fault_hook
from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.sdc.inject import FlipSpec
from lightning_resilience.testing.faults import FaultPlan
from tests.sdc._loop import train
from tests.sdc._spawn import run_ranks

pytestmark = pytest.mark.timeout(150)

STEPS = 8
CONFIG = dict(replay_every_n_steps=1, reconcile_every_n_steps=1)


def _scenario(rank: int, plan: list[FlipSpec], faulty_rank: int | None) -> dict[str, Any]:
    clean, _, _ = train(STEPS, None, rank=rank, ddp=True)
    final, _, monitor = train(
        STEPS, SDCConfig(**CONFIG), rank=rank, ddp=True, plan=plan, faulty_every_k=1 if rank == faulty_rank else 0
    )
    assert monitor is not None
    return {
        "equal_to_clean": all(torch.equal(final[k], clean[k]) for k in clean),
        "events": [e.to_json() for e in monitor.events],
        "dirty": monitor.dirty,
        "verified": sorted(monitor.verified_steps),
        "hook_calls": monitor._hook.calls if monitor._hook is not None else 0,
        "rollback": monitor.rollback_target(range(STEPS + 1)),
    }


def _summary(results: list[dict[str, Any]]) -> list[tuple[int, str, str, list[int]]]:
    # every rank must have reached the same verdicts (they are computed from the same gathered data)
    views = [[(e["step"], e["verdict"], e["action"], e["suspects"]) for e in r["events"]] for r in results]
    assert all(v == views[0] for v in views), views
    return views[0]


def test_clean_ddp_run_no_false_positive(tmp_path: Path) -> None:
    results = run_ranks(_scenario, 3, tmp_path, [], None)
    assert _summary(results) == []
    assert all(r["equal_to_clean"] and not r["dirty"] and r["hook_calls"] >= STEPS for r in results)
    assert results[0]["verified"] == list(range(STEPS + 1))


@pytest.mark.parametrize(("location", "bit_class"), [("grad", "sign"), ("activation", "mantissa_high")])
def test_corrupt_local_gradient_is_named_and_recomputed(tmp_path: Path, location: str, bit_class: str) -> None:
    plan = [FlipSpec(location, step=4, rank=2, bit_class=bit_class, seed=1)]  # type: ignore[arg-type]
    results = run_ranks(_scenario, 3, tmp_path, plan, None)
    assert _summary(results) == [(5, "transient", "recomputed", [2])]
    assert all(r["equal_to_clean"] and not r["dirty"] for r in results)  # the all-reduce never spread the error


@pytest.mark.parametrize(("world", "verdict", "suspects"), [(3, "diverged", [1]), (2, "inconclusive", [])])
def test_diverged_replica_is_named_by_a_majority_of_three_and_by_nobody_of_two(
    tmp_path: Path, world: int, verdict: str, suspects: list[int]
) -> None:
    plan = [FlipSpec("optim", step=3, rank=1, bit_class="mantissa_low", seed=4)]
    results = run_ranks(_scenario, world, tmp_path, plan, None)
    assert _summary(results) == [(4, verdict, "rollback", suspects)]
    assert all(r["dirty"] and r["rollback"] == 3 for r in results)  # newest step verified on every rank


@contextlib.contextmanager
def _ops_counted() -> Iterator[dict[str, int]]:
    """Side-group operations entered on this rank while the block runs, by name (through the fault hook)."""
    ops: dict[str, int] = {}

    def count(op: str, _rank: int, _step: int | None) -> None:
        ops[op] = ops.get(op, 0) + 1

    set_fault_hook(count)
    try:
        yield ops
    finally:
        set_fault_hook(None)


def _counted(rank: int, plan: list[FlipSpec]) -> dict[str, Any]:
    with _ops_counted() as ops:
        _, _, monitor = train(STEPS, SDCConfig(replay_every_n_steps=0, reconcile_every_n_steps=1), rank=rank,
                              ddp=True, plan=plan)  # fmt: skip
    assert monitor is not None
    return {"ops": ops, "events": [e.to_json() for e in monitor.events], "rounds": monitor.stats.reconcile_rounds}


@pytest.mark.parametrize("world", [2, 4])
def test_a_clean_reconciliation_sends_one_hash_and_gathers_nothing(tmp_path: Path, world: int) -> None:
    results = run_ranks(_counted, world, tmp_path, [])
    for r in results:
        assert r["rounds"] == STEPS and r["events"] == []
        assert r["ops"].get("sdc.reconcile") == STEPS  # one all-reduce of two integers a round, at any N
        assert r["ops"].get("sdc.gather", 0) == 1  # the hosts, once at setup: no digests travel on a clean round


def test_replicas_whose_hashes_differ_gather_their_digests_and_vote(tmp_path: Path) -> None:
    plan = [FlipSpec("optim", step=3, rank=1, bit_class="mantissa_low", seed=4)]
    results = run_ranks(_counted, 3, tmp_path, plan)
    assert _summary(results) == [(4, "diverged", "rollback", [1])]
    assert all(r["ops"].get("sdc.gather", 0) == 2 for r in results)  # setup, and the one round that differed


def test_faulty_device_is_named_persistent(tmp_path: Path) -> None:
    results = run_ranks(_scenario, 3, tmp_path, [], 1)
    events = _summary(results)
    assert (1, "persistent", "rollback", [1]) in events  # its own batch: it reproduces a wrong answer
    assert all(e[0] == 1 and e[1] == "persistent" and e[3] == [1] for e in events)  # and as a partner: named too
    assert all(r["dirty"] and r["rollback"] == 0 for r in results)


def test_faulty_device_on_two_ranks_is_inconclusive_and_blames_nobody(tmp_path: Path) -> None:
    results = run_ranks(_scenario, 2, tmp_path, [], 1)
    events = _summary(results)
    assert events and all(e[1] == "inconclusive" and e[2] == "rollback" and e[3] == [] for e in events), events
    assert all(r["dirty"] and r["rollback"] == 0 for r in results)  # still rejected: a rollback, no rank blamed


SCHEDULED = dict(replay_every_n_steps=2, reconcile_every_n_steps=0, replay_scope="rotate", ddp_fingerprint=False)


def _scheduled_rounds(rank: int, faulty_rank: int | None, boxed: bool = False, scope: str = "rotate") -> dict[str, Any]:
    """Scheduled replay rounds (of one batch by turns, or on every device), no communication hook: a device that
    flips a low mantissa bit of every gradient it computes (no guard sees it) is met as the owner of a batch or as
    its partner."""
    with _ops_counted() as ops:
        _, _, monitor = train(
            STEPS, SDCConfig(**{**SCHEDULED, "replay_scope": scope}), rank=rank, ddp=True,
            faulty_every_k=1 if rank == faulty_rank else 0, faulty_bit_class="mantissa_low", boxed=boxed,
        )  # fmt: skip
    assert monitor is not None and monitor._hook is None
    return {
        "events": [e.to_json() for e in monitor.events],
        "dirty": monitor.dirty,
        "rounds": monitor.stats.replay_rounds,
        "replays": monitor.stats.replays,
        "gathers": ops.get("sdc.gather", 0),
        "neighbours": ops.get("sdc.neighbours", 0),
        "agreed": ops.get("sdc.any", 0),
    }


def test_rotating_replay_meets_a_faulty_device_by_turns(tmp_path: Path) -> None:
    world = 3
    (tmp_path / "clean").mkdir()
    (tmp_path / "faulty").mkdir()
    clean = run_ranks(_scheduled_rounds, world, tmp_path / "clean", None)
    assert _summary(clean) == [] and all(r["rounds"] == STEPS // 2 for r in clean)
    # one batch per round: its owner and its neighbour replay it (2 replays a round on 3 ranks, not 6)
    assert sum(r["replays"] for r in clean) == 2 * STEPS // 2
    # a clean round gathers nothing: the batch goes to its partner, each rank swaps its replays' digests with its
    # neighbours, and two all-reduces of a flag (every batch can travel as tensors; every pair agreed) do the rest:
    # what a rank sends does not grow with the number of ranks
    assert all(r["gathers"] == 1 for r in clean), [r["gathers"] for r in clean]  # 1: setup
    assert all(r["neighbours"] == 2 * STEPS // 2 and r["agreed"] == 2 * STEPS // 2 for r in clean), clean
    results = run_ranks(_scheduled_rounds, world, tmp_path / "faulty", world - 1)
    [first, *_] = _summary(results)
    assert (first[1], first[2], first[3]) == ("persistent", "rollback", [2]), first
    assert first[0] <= 2 * world and all(r["dirty"] for r in results)


@pytest.mark.parametrize("world", [3, 4])
def test_a_round_on_every_device_meets_a_faulty_device_at_once(tmp_path: Path, world: int) -> None:
    """``replay_scope=devices``: every other rank's batch, by its rank and its neighbour, from an offset that moves
    each round, so each device replays once a round (the rank at the offset twice when the number of ranks is odd),
    and nothing is gathered. A faulty device on the last rank, which ``rotate`` meets only at its turns, is named by
    the first round."""
    (tmp_path / "clean").mkdir()
    (tmp_path / "faulty").mkdir()
    rounds = STEPS // 2
    clean = run_ranks(_scheduled_rounds, world, tmp_path / "clean", None, False, "devices")
    assert _summary(clean) == [] and all(r["rounds"] == rounds for r in clean)
    replays = [r["replays"] for r in clean]
    if world % 2 == 0:
        assert replays == [rounds] * world, replays
    else:  # the offset moves by one a round: rounds 0..3 on 3 ranks double on ranks 0, 1, 2, 0
        assert replays == [rounds + 2, rounds + 1, rounds + 1], replays
    assert all(r["gathers"] == 1 and r["neighbours"] == 2 * rounds for r in clean), clean  # 1: setup
    results = run_ranks(_scheduled_rounds, world, tmp_path / "faulty", world - 1, False, "devices")
    [first, *_] = _summary(results)
    assert (first[1], first[2], first[3]) == ("persistent", "rollback", [world - 1]), first
    assert first[0] == 2 and all(r["dirty"] for r in results)  # the first round (step 2)


def test_a_batch_of_the_users_own_type_goes_by_the_gather(tmp_path: Path) -> None:
    """What a neighbour reads back is limited to tensors and built-in values (``torch.load(weights_only=True)``): with
    a batch of the user's own type the ranks agree to take the round's gathers (torch's own unpickling), and it still
    checks one batch by turns."""
    results = run_ranks(_scheduled_rounds, 3, tmp_path, None, True)
    assert _summary(results) == [] and all(r["rounds"] == STEPS // 2 for r in results)
    assert sum(r["replays"] for r in results) == 2 * STEPS // 2
    assert all(r["gathers"] == 1 + 2 * STEPS // 2 and r["neighbours"] == 0 for r in results), results


def _guard_fires_at_steps(rank: int, guard: str, steps: tuple[int, ...], quiet_steps: int) -> dict[str, Any]:
    """An instability that goes on for a while, alike on every rank: a gradient-norm spike at each of ``steps``
    (``guard="grad_norm_spike"``), or a parameter norm that doubles at each of them and stays there
    (``"param_norm_jump"``). Returns the rounds the guard asks for: replays, or reconciliations."""
    from lightning_resilience.sdc.guards import Guards

    check = Guards.check

    def fires(self: Guards, step: int, loss: Any, grad: Any, param: Any = None) -> Any:
        if guard == "grad_norm_spike" and step in steps:  # far above the baseline: the guard fires (and may be quiet)
            grad = 1e6
        if guard == "param_norm_jump" and param is not None:
            param *= 2 ** sum(step >= s for s in steps)
        return check(self, step, loss, grad, param)

    Guards.check = fires  # type: ignore[method-assign]
    config = SDCConfig(
        replay_every_n_steps=0, reconcile_every_n_steps=0, ddp_fingerprint=False, guard_min_history=2,
        guard_quiet_steps=quiet_steps, guard_grad_norm_stride=1,  # every rank's baseline warm by step 3
        param_norm_every_n_steps=1 if guard == "param_norm_jump" else 10,
    )  # fmt: skip
    _, _, monitor = train(STEPS, config, rank=rank, ddp=True)
    assert monitor is not None
    st = monitor.stats
    return {
        "events": [e.to_json() for e in monitor.events],
        "rounds": st.replay_rounds if guard == "grad_norm_spike" else st.reconcile_rounds,
        "fired": st.guard_fired.get(guard, 0),
        "verified": sorted(monitor.verified_steps),
    }


@pytest.mark.parametrize(("quiet_steps", "rounds"), [(0, 2), (50, 1)])
def test_a_spike_found_genuine_quiets_its_guard(tmp_path: Path, quiet_steps: int, rounds: int) -> None:
    """Gradient-norm spikes at steps 3 and 5: each asks for a replay round, unless the first round found its spike
    genuine less than ``guard_quiet_steps`` before (the second is still counted on every rank)."""
    results = run_ranks(_guard_fires_at_steps, 2, tmp_path, "grad_norm_spike", (3, 5), quiet_steps)
    assert all(r["rounds"] == rounds and r["fired"] == 2 for r in results), results
    assert _summary(results) == [(5, "anomaly", "none", [])] + ([(7, "anomaly", "none", [])] if rounds == 2 else [])


@pytest.mark.parametrize(("quiet_steps", "rounds"), [(0, 2), (50, 1)])
def test_a_jump_a_reconciliation_found_clean_quiets_its_guard(tmp_path: Path, quiet_steps: int, rounds: int) -> None:
    """Parameter-norm jumps at steps 3 and 6: each asks for a reconciliation, unless the first one found the replicas
    equal less than ``guard_quiet_steps`` before (the second is still counted on every rank); nothing is named and
    nothing rolled back (a young baseline's gradient-norm spike may ask for a replay that finds it genuine)."""
    results = run_ranks(_guard_fires_at_steps, 2, tmp_path, "param_norm_jump", (3, 6), quiet_steps)
    assert all(r["rounds"] == rounds and r["fired"] == 2 for r in results), results
    assert all(e[1:] == ("anomaly", "none", []) for e in _summary(results)), results
    assert all(5 in r["verified"] for r in results), results


def _grad_norm_turns(rank: int, stride: int, flip_at: int | None) -> dict[str, Any]:
    """The steps whose gradient norm this rank computed, and what its guards found at each step (``flip_at``: rank 1
    flips the top exponent bit of one of its local gradients, before the all-reduce)."""
    from lightning_resilience.sdc.guards import GuardReader

    observe, arrived = GuardReader.observe, GuardReader.arrived
    computed: list[int] = []
    found: dict[int, list[str]] = {}

    def recorded(self: GuardReader, step: int, loss: Any, grad: Any, param: Any, **kw: Any) -> Any:
        if grad is not None:
            computed.append(step)
        return observe(self, step, loss, grad, param, **kw)

    def read(self: GuardReader) -> Any:
        reports = arrived(self)
        for report in reports:
            found.setdefault(report.step, []).extend(report.fired)
        return reports

    GuardReader.observe, GuardReader.arrived = recorded, read  # type: ignore[method-assign]
    config = SDCConfig(
        replay_every_n_steps=0, reconcile_every_n_steps=0, ddp_fingerprint=False, guard_min_history=2,
        guard_grad_norm_stride=stride,
    )  # fmt: skip
    plan = [] if flip_at is None else [FlipSpec("grad", flip_at, 1, bit=30, target="blocks.0.mlp.fc.weight")]
    _, _, monitor = train(STEPS, config, rank=rank, ddp=True, plan=plan)
    assert monitor is not None
    return {"computed": computed, "found": found, "rounds": monitor.stats.replay_rounds, "dirty": monitor.dirty}


@pytest.mark.parametrize(("world", "stride"), [(2, 4), (3, 2), (2, 1)])
def test_ranks_take_turns_at_the_gradient_norm(tmp_path: Path, world: int, stride: int) -> None:
    """Under DDP the gradients are the same on every rank after the all-reduce: step ``s``'s norm is computed by the
    ranks ``r`` with ``r % k == s % k`` (``k = min(world, stride)``), so every step is checked and each rank does
    ``1/k`` of the work; a stride of 1 checks every step on every rank."""
    results = run_ranks(_grad_norm_turns, world, tmp_path, stride, None)
    k = min(world, stride)
    for rank, r in enumerate(results):
        assert r["computed"] == [s for s in range(STEPS) if s % k == rank % k], (rank, r)
    assert sorted({s for r in results for s in r["computed"]}) == list(range(STEPS))


def test_a_gradient_flip_on_one_rank_is_found_at_another_ranks_turn(tmp_path: Path) -> None:
    """Rank 1's local gradient is corrupted at step 6, rank 0's turn: the all-reduce carries the corruption to every
    rank, rank 0's guard finds it (rank 1 did not compute that norm), and the late guards' agreement has every rank
    act alike: replay the next step (a spike), or stop training on the update (a non-finite norm)."""
    results = run_ranks(_grad_norm_turns, 2, tmp_path, 4, 6)
    first, second = results
    assert 6 in first["computed"] and 6 not in second["computed"]
    assert {"grad_norm_spike", "nonfinite_grad"} & set(first["found"].get("6", [])), first["found"]
    assert not {"grad_norm_spike", "nonfinite_grad"} & set(second["found"].get("6", [])), second["found"]
    acted = [(r["rounds"], r["dirty"]) for r in results]
    assert acted[0] == acted[1] and (acted[0][0] >= 1 or acted[0][1]), acted


def _guard_fires_at_step_6(rank: int, kind: str, faulty_rank: int | None = None) -> dict[str, Any]:
    """A guard fires at step 6 (read a step late, so step 7 is replayed): a loss spike on rank 1 alone, or a
    gradient-norm spike, which every rank sees (it is taken after the all-reduce). No scheduled replay.
    ``faulty_rank``: a device that flips a low mantissa bit of every gradient it computes (no guard sees it)."""
    from lightning_resilience.sdc.guards import Guards

    check = Guards.check

    def fires(self: Guards, step: int, *args: Any) -> Any:
        report = check(self, step, *args)
        if step == 6 and (kind == "grad_norm_spike" or rank == 1):
            report.fired.append(kind)
        return report

    Guards.check = fires  # type: ignore[method-assign]
    config = SDCConfig(replay_every_n_steps=0, reconcile_every_n_steps=0, ddp_fingerprint=False)
    with _ops_counted() as ops:
        _, _, monitor = train(
            STEPS, config, rank=rank, ddp=True, faulty_every_k=1 if rank == faulty_rank else 0,
            faulty_bit_class="mantissa_low",
        )  # fmt: skip
    assert monitor is not None
    return {
        "events": [e.to_json() for e in monitor.events],
        "rounds": monitor.stats.replay_rounds,
        "replays": monitor.stats.replays,
        "gathers": ops.get("sdc.gather", 0),
    }


@pytest.mark.parametrize(
    ("kind", "replays"),
    [("loss_spike", [0, 1, 1]), ("grad_norm_spike", [2, 1, 1]), ("grad_norm_spike", [1, 1, 1, 1])],
)
def test_a_ranks_own_guard_replays_its_batch_alone(tmp_path: Path, kind: str, replays: list[int]) -> None:
    """A loss is one rank's own: its spike on rank 1 has rank 1 and its partner (rank 2) replay rank 1's batch, and
    nobody else replays (a false alarm on one of N ranks costs two replays, not 2N). A gradient-norm spike speaks for
    every rank and names no batch: every other rank's batch is replayed, by its rank and its partner, so that every
    device replays once (rank 0 twice when the number of ranks is odd). Either way nothing is gathered (1: setup)."""
    results = run_ranks(_guard_fires_at_step_6, len(replays), tmp_path, kind)
    assert [r["replays"] for r in results] == replays, results
    assert all(r["rounds"] == 1 and r["gathers"] == 1 for r in results), results
    # the replay reproduced the step: not a faulty device, and no rank is named
    assert _summary(results) == [(8, "anomaly", "none", [])]


@pytest.mark.parametrize("faulty_rank", [1, 2])
def test_a_job_wide_guard_meets_a_faulty_device_wherever_it_is(tmp_path: Path, faulty_rank: int) -> None:
    """The gradient-norm spike's round replays each device once: a faulty device is met as a batch's partner (rank 1
    replays rank 0's batch) or as its owner (rank 2), and a majority of three names it."""
    results = run_ranks(_guard_fires_at_step_6, 3, tmp_path, "grad_norm_spike", faulty_rank)
    [first, *_] = _summary(results)
    assert (first[0], first[1], first[2], first[3]) == (8, "persistent", "rollback", [faulty_rank]), first


def _agreement_hangs_on_one_rank(rank: int) -> dict[str, Any]:
    """Rank 1 stops before the late guards' agreement of step 3 (it is stuck elsewhere): the others must get the
    collective layer's typed error within ``sdc.timeout_s``, not wait on a group of their own without a deadline."""
    plan = FaultPlan(hang_limit=timedelta(seconds=8)).fail_at(1, 3, "sdc.late_guards", "hang")
    start = time.monotonic()
    try:
        with plan.armed():
            train(STEPS, SDCConfig(timeout_s=2.0), rank=rank, ddp=True)
    except Exception as err:  # every rank reports what ended it
        return {"error": type(err).__name__, "message": str(err), "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def test_an_sdc_agreement_a_rank_never_joins_is_a_typed_error_within_its_timeout(tmp_path: Path) -> None:
    results = run_ranks(_agreement_hangs_on_one_rank, 3, tmp_path)
    for rank in (0, 2):
        assert results[rank]["error"] == "CollectiveTimeoutError", results[rank]
        assert "sdc.late_guards" in results[rank]["message"], results[rank]
        assert results[rank]["elapsed"] < 30, results[rank]
    assert results[1]["error"] is not None, results[1]  # released after 8 s into a broken agreement
