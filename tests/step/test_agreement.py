"""The step agreement: a vector of fields, each with its own reduction, agreed along a tree of real gloo ranks off
the training thread; a gather of payloads to rank 0; errors and deadlines on every rank."""

from __future__ import annotations

import os
import struct
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from lightning_resilience.collective import CollectiveError, CollectiveTimeoutError, SideGroup, set_fault_hook
from lightning_resilience.links import SharedBuffer
from lightning_resilience.step.agreement import Gathered, Op, Pending, TreeAgreement, combine, frame, unframe
from tests._ranks import run_ranks

OPS = [Op.MAX, Op.MIN, Op.AND, Op.OR, Op.SUM]


def _values(rank: int, round_: int) -> list[int]:
    return [rank * round_, 100 - rank - round_, 0b111 & ~(1 << (rank % 3)), 1 << (rank % 5), 1]


def test_combine_reduces_each_field_by_its_own_op() -> None:
    assert combine(OPS, [3, 3, 0b110, 0b001, 2], [5, 1, 0b011, 0b100, 3]) == [5, 1, 0b010, 0b101, 5]


def test_one_process_agrees_at_once_with_itself() -> None:
    tree = TreeAgreement(SideGroup("step", timedelta(seconds=5), local=True))
    pending = tree.reduce([1, 2, 3, 4, 5], OPS, op="step.agree", step=0)
    assert pending.done() and pending.result() == [1, 2, 3, 4, 5]
    assert tree.gather(b"x", op="g").result().records() == [(0, b"x")]
    assert tree.depth == 0 and tree.parent is None and tree.children == []


def test_the_tree_is_shallow_and_each_rank_talks_to_few_peers() -> None:
    group = SideGroup("step", timedelta(seconds=5), local=True)
    group.rank, group.world_size = 5, 10_000
    tree = TreeAgreement(group, fanout=4)
    assert tree.parent == 1 and tree.children == [21, 22, 23, 24]
    assert tree.depth == 7  # 4-ary: 1 + 4 + ... + 4**7 > 10,000 ranks


def _scenario_rounds(rank: int, world: int, tmp: Path, fanout: int, transport: str) -> dict[str, Any]:
    group = SideGroup("step", timedelta(seconds=30), transport=transport)
    tree = TreeAgreement(group, fanout=fanout)
    main = threading.get_ident()
    seen: list[int] = []

    def hook(op: str, r: int, step: int | None) -> None:
        seen.append(threading.get_ident())

    set_fault_hook(hook)
    try:
        pendings = [tree.reduce(_values(rank, i), OPS, op="step.agree", step=i) for i in range(5)]
        gathered = tree.gather(f"rank{rank}".encode(), op="straggler.exchange", step=5)
        results = [p.result() for p in pendings]
        got = gathered.result()
    finally:
        set_fault_hook(None)
        tree.close()
    linked = group._link.tcp.peers if group._link.tcp is not None else None
    group.close()
    return {
        "results": results,
        "gathered": [[r, b.decode()] for r, b in got.records()],
        "blobs": len(got.blobs),
        "on_training_thread": sum(t == main for t in seen),
        "peers": len(tree.children) + (tree.parent is not None),
        "linked": linked,
        "tree": sorted([*tree.children, *([] if tree.parent is None else [tree.parent])]),
        "fds": len(os.listdir("/proc/self/fd")),
    }


@pytest.mark.parametrize("world,fanout,transport", [(2, 4, "gloo"), (7, 2, "gloo"), (2, 4, "tcp"), (7, 2, "tcp")])
def test_every_rank_gets_the_same_reduction_and_rank_0_the_gathered_payloads(
    tmp_path: Path, world: int, fanout: int, transport: str
) -> None:
    results = run_ranks(_scenario_rounds, world, tmp_path, fanout, transport)
    for i in range(5):
        expected = _values(0, i)
        for r in range(1, world):
            expected = combine(OPS, expected, _values(r, i))
        assert all(res["results"][i] == expected for res in results), i
    assert results[0]["gathered"] == [[r, f"rank{r}"] for r in range(world)]
    assert all(res["gathered"] == [] for res in results[1:])
    # rank 0 keeps what came unparsed: its own record and one blob per child, each holding its whole subtree
    assert results[0]["blobs"] == 1 + min(fanout, world - 1) and all(res["blobs"] == 0 for res in results[1:])
    assert all(res["on_training_thread"] == 0 for res in results)  # every exchange ran on the agreement thread
    assert all(res["peers"] <= fanout + 1 for res in results)
    if transport == "tcp":  # a link to each tree neighbour, to no other rank
        assert all(res["linked"] == res["tree"] for res in results)


def _scenario_missing_rank(rank: int, world: int, tmp: Path, transport: str) -> dict[str, Any]:
    tree = TreeAgreement(SideGroup("step", timedelta(seconds=2), transport=transport))
    if rank == 1:  # never takes part: hung, or on another path
        threading.Event().wait(4)
        return {"error": None}
    pending = tree.reduce([rank], [Op.MAX], op="step.agree", step=3)
    try:
        pending.result(timedelta(seconds=10))
        error = None
    except CollectiveError as err:
        error = type(err).__name__
    later = tree.reduce([rank], [Op.MAX], op="step.agree", step=4)
    try:
        later.result()
    except CollectiveError as err:  # broken from then on: at once
        error = f"{error},{type(err).__name__}"
    tree.close(timedelta(seconds=1))
    return {"error": error}


@pytest.mark.parametrize("transport", ["gloo", "tcp"])
def test_a_rank_that_never_comes_is_a_typed_error_within_the_deadline(tmp_path: Path, transport: str) -> None:
    results = run_ranks(_scenario_missing_rank, 3, tmp_path, transport, deadline_s=60)
    assert results[0]["error"] is not None and results[0]["error"].startswith("CollectiveTimeoutError")
    assert results[2]["error"] is not None and results[2]["error"].startswith("CollectiveTimeoutError")


def test_a_result_that_does_not_arrive_in_time_breaks_the_agreement() -> None:
    tree = TreeAgreement(SideGroup("step", timedelta(seconds=5), local=True))
    pending = Pending(tree, "step.agree", 9)  # never completed
    with pytest.raises(CollectiveTimeoutError, match=r"step\.agree of step 9 not agreed within 0\.01s"):
        pending.result(timedelta(seconds=0.01))
    assert tree.stats.waits == 1


class _Send:
    """A send still in flight until the test lets it land."""

    def __init__(self) -> None:
        self.waited, self.landed = threading.Event(), threading.Event()

    def is_completed(self) -> bool:
        return self.landed.is_set()

    def wait(self, timeout: timedelta) -> bool:
        self.waited.set()
        if not self.landed.wait(timeout.total_seconds()):
            raise CollectiveTimeoutError("send not delivered", op="step.agree", group="step")
        return True


class _ParentGroup:
    """Rank 0 of 2: its child's part arrives at once; what it sends down stays in flight until the test says."""

    name, timeout, rank, world_size, distributed = "step", timedelta(seconds=30), 0, 2, True

    def __init__(self) -> None:
        self.sends: list[_Send] = []

    def swap(self, sends: Any, recvs: Any, **_: Any) -> tuple[list[bytes], list[_Send]]:
        received = [struct.pack(f"<{n // 8}q", *[7] * (n // 8)) for _, n in recvs]
        self.sends += [_Send() for _ in sends]
        return received, self.sends[-len(sends) :] if sends else []


def test_close_delivers_the_last_rounds_answer_before_the_thread_ends() -> None:
    """A child slower than its parent must still receive the last agreed vector: the parent's close waits for the
    send (bounded) instead of dropping it with the group."""
    group = _ParentGroup()
    tree = TreeAgreement(group)  # type: ignore[arg-type]
    assert tree.thread_cpu_seconds() is None  # no round yet: no thread
    assert tree.reduce([3], [Op.MAX], op="step.agree", step=0).result() == [7]
    cpu = tree.thread_cpu_seconds()
    assert cpu is not None and cpu > 0  # the thread's own CPU clock (what benchmarks.agreement_transport reads)
    (send,) = group.sends
    closed: list[bool] = []
    closer = threading.Thread(target=lambda: closed.append(tree.close(timedelta(seconds=30))))
    closer.start()
    assert send.waited.wait(10)  # the thread is waiting for the send to land
    assert closer.is_alive() and not closed
    send.landed.set()
    closer.join(10)
    assert closed == [True]


def test_close_gives_up_on_an_answer_a_peer_never_takes_within_its_bound() -> None:
    group = _ParentGroup()
    tree = TreeAgreement(group)  # type: ignore[arg-type]
    tree.reduce([3], [Op.MAX], op="step.agree", step=0).result()
    assert tree.close(timedelta(seconds=0.2))  # logged; the thread ends within the bound
    assert group.sends[0].waited.is_set() and not group.sends[0].landed.is_set()


def test_framed_blobs_concatenate_and_read_back_in_rank_order() -> None:
    low, high = frame([(3, b"three"), (0, b"")]), frame([(7, b"seven" * 1000), (1, b"one")])
    assert unframe([high + low]) == unframe([low, high]) == [(0, b""), (1, b"one"), (3, b"three"), (7, b"seven" * 1000)]
    assert Gathered((low, high)).records() == unframe([low, high]) and Gathered((low,)).nbytes == len(low)
    assert not Gathered() and unframe([]) == []
    with pytest.raises(ValueError, match="cut short"):
        unframe([high[:-1]])
    with pytest.raises(ValueError, match="head"):
        unframe([low + b"\x01\x00"])


class _RootGroup:
    """Rank 0 of ``world`` ranks (fanout 4): each child's blob of its subtree's records arrives at once."""

    name, timeout, rank, distributed = "step", timedelta(seconds=30), 0, True

    def __init__(self, world: int, parts: list[bytes]) -> None:
        self.world_size, self.parts = world, parts

    def receive(self, recv_from: Any, **_: Any) -> list[Any]:
        return list(self.parts[: len(recv_from)])


def test_rank_0_keeps_the_gathered_blobs_as_they_came_whatever_the_number_of_ranks() -> None:
    """At 16,384 ranks rank 0 receives megabytes of records each exchange: the agreement thread (in the training
    process, under its interpreter lock) neither parses nor copies them (they stay in the shared memory they were
    received into); whoever reads them calls ``records()``."""
    world = 16_384
    subtree = (world - 1) // 4 + 1
    parts = [SharedBuffer.holding(frame([(r, b"t" * 600) for r in range(1 + i, world, 4)][:subtree])) for i in range(4)]
    tree = TreeAgreement(_RootGroup(world, parts))  # type: ignore[arg-type]
    try:
        got = tree.gather(b"mine", op="straggler.exchange", step=10).result()
    finally:
        tree.close()
    assert got.blobs[0] == frame([(0, b"mine")])
    assert all(blob is part for blob, part in zip(got.blobs[1:], parts))  # the very objects received
    records = got.records()
    assert [r for r, _ in records] == list(range(world)) and records[0] == (0, b"mine")


def _scenario_side_reductions(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_resilience.step.channels import Channels

    channels = Channels([timedelta(seconds=30)], timedelta(seconds=30), fanout=2)
    side = channels.side("sdc", timedelta(seconds=30))
    gloo = {"p2p": 0, "all_reduce": 0}
    calls = {name: getattr(dist, name) for name in ("isend", "irecv", "all_reduce")}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            gloo["all_reduce" if name == "all_reduce" else "p2p"] += 1
            return calls[name](*args, **kwargs)

        return call

    for name in calls:
        setattr(dist, name, counted(name))
    try:
        round_ = channels.agreement.reduce([rank], [Op.MAX], op="step.agree", step=7)  # a step's round, in flight
        out = {
            "all_true": side.all_true(rank != 3, op="sdc.all"),
            "any_true": side.any_true(rank == 4, op="sdc.any"),
            "max": side.reduce_max(rank * 10, op="sdc.max"),
            "min": side.reduce_min(100 - rank, op="sdc.min"),
            "and_each": side.reduce_and_each([0b111 & ~(1 << (rank % 3)), -1], op="sdc.and"),
            "max_each": side.reduce_max_each([rank, -rank], op="sdc.reconcile"),
        }
        out["round"] = round_.result()
        stats = channels.agreement.stats
        out["stats"] = [stats.rounds, stats.side_reductions, stats.waits]
        out["gloo"] = dict(gloo)
        channels.close()  # the agreement's thread is gone: a reduction is gloo's all-reduce again
        out["after_close"] = side.reduce_max(rank, op="sdc.max")
        out["gloo_after_close"] = dict(gloo)
    finally:
        for name, fn in calls.items():
            setattr(dist, name, fn)
    return out


def test_the_side_groups_reductions_ride_the_agreements_tree_and_open_no_socket(tmp_path: Path) -> None:
    """A side group's reductions (an SDC reconciliation's hash, a replay round's flags) go along the agreement's
    tree, on its thread and links, after the round already issued: no gloo message, no ring of 2 (N - 1) hops."""
    results = run_ranks(_scenario_side_reductions, 5, tmp_path)
    for res in results:
        assert (res["all_true"], res["any_true"], res["max"], res["min"]) == (False, True, 40, 96)
        assert res["and_each"] == [0, -1] and res["max_each"] == [4, 0] and res["round"] == [4]
        assert res["stats"] == [1, 6, 0]  # one step round; six side reductions; no step round waited for
        assert res["gloo"] == {"p2p": 0, "all_reduce": 0}
        assert res["after_close"] == 4 and res["gloo_after_close"] == {"p2p": 0, "all_reduce": 1}


def _scenario_side_missing_rank(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    import time

    from lightning_resilience.step.channels import Channels

    channels = Channels([timedelta(seconds=30)], timedelta(seconds=30))
    side = channels.side("sdc", timedelta(seconds=2))
    outcome: dict[str, Any] = {}
    if rank != 1:  # rank 1 takes another path: it never enters the reduction (but stays alive)
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError):
            side.all_true(True, op="sdc.reconcile")
        outcome["waited"] = time.monotonic() - start
        start = time.monotonic()
        with pytest.raises(CollectiveError):  # broken: the next call fails at once
            side.any_true(True, op="again")
        outcome["second"] = time.monotonic() - start
    else:
        threading.Event().wait(4)
    channels.close()
    return outcome


def test_a_side_reduction_a_rank_never_joins_is_a_timeout_within_its_own_bound(tmp_path: Path) -> None:
    results = run_ranks(_scenario_side_missing_rank, 3, tmp_path, deadline_s=60)
    for rank in (0, 2):
        assert 1.5 <= results[rank]["waited"] < 12 and results[rank]["second"] < 1.0


def _scenario_side_outwaits_the_round(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    from lightning_resilience.step.channels import Channels

    channels = Channels([timedelta(seconds=30)], timedelta(seconds=1))  # a step's round: 1 s at most
    side = channels.side("checkpoint", timedelta(seconds=30))
    if rank == 1:  # late by more than a round's bound (a slow restore), well within the checkpoint's own
        threading.Event().wait(2.5)
    agreed = side.all_true(True, op="checkpoint.restore")
    if rank == 1:  # its step's round comes as late: past the round's bound
        threading.Event().wait(2.5)
    late = channels.agreement.reduce([rank], [Op.MAX], op="step.agree", step=0)
    try:
        late.result()
        round_error = None
    except CollectiveError as err:
        round_error = type(err).__name__
    channels.close()
    return {"agreed": agreed, "round_error": round_error}


def test_a_side_reduction_waits_as_long_as_its_own_view_says_and_a_round_as_the_policy_says(tmp_path: Path) -> None:
    results = run_ranks(_scenario_side_outwaits_the_round, 2, tmp_path, deadline_s=60)
    assert [r["agreed"] for r in results] == [True, True]
    assert results[0]["round_error"] == "CollectiveTimeoutError"  # rank 0 waited 1 s for rank 1's round
