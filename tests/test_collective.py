"""The collective layer: agreements on real gloo ranks, and a typed error on every rank within the deadline when a
peer is late, gone or on another path."""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lightning_resilience.collective import CollectiveError, CollectiveTimeoutError, Deadline, SideGroup
from lightning_resilience.rank_tree import RankTree
from tests._ranks import run_ranks

SHORT = timedelta(seconds=3)


def _agreements(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    group = SideGroup("test", timedelta(seconds=30))
    gathered = group.all_gather_object({"rank": rank, "blob": "x" * (rank * 1000)}, op="gather")
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    got = group.exchange(None if rank == 1 else f"from {rank}".encode(), send_to=[nxt], recv_from=[prev], op="ring")
    return {
        "gathered": [g["rank"] for g in gathered],
        "sizes": [len(g["blob"]) for g in gathered],
        "all_true": group.all_true(rank != 1, op="all"),
        "any_true": group.any_true(rank == 1, op="any"),
        "max": group.reduce_max(rank * 10, op="max"),
        "min": group.reduce_min(rank * 10 + 5, op="min"),
        "received": [None if g is None else g.decode() for g in got],
        "tensors": [t.tolist() for t in group.all_gather_tensor(dist_tensor(rank), op="tensor")],
        "max_each": group.reduce_max_each([rank, -rank, 7], op="max_each"),
        "any_type": [t.tolist() for t in group.all_gather_object(dist_tensor(rank), op="objects", any_type=True)],
    }


def dist_tensor(rank: int) -> Any:
    import torch

    return torch.tensor([float(rank), 0.5])


def test_agreements_on_three_ranks(tmp_path: Path) -> None:
    results = run_ranks(_agreements, 3, tmp_path)
    for rank, res in enumerate(results):
        assert res["gathered"] == [0, 1, 2] and res["sizes"] == [0, 1000, 2000]
        assert (res["all_true"], res["any_true"], res["max"], res["min"]) == (False, True, 20, 5)
        assert res["tensors"] == res["any_type"] == [[0.0, 0.5], [1.0, 0.5], [2.0, 0.5]]
        assert res["max_each"] == [2, 0, 7]
        prev = (rank - 1) % 3
        assert res["received"] == [None if prev == 1 else f"from {prev}"]


def test_a_rank_tree_links_every_rank_once_and_its_depth_is_logarithmic() -> None:
    for n in (1, 2, 5, 6, 21, 22, 10_000):
        trees = [RankTree(r, n) for r in range(n)]
        assert trees[0].parent is None
        assert all(trees[t.parent].children.count(r) == 1 for r, t in enumerate(trees) if t.parent is not None)
        assert sum(len(t.children) for t in trees) == n - 1  # one parent each, rank 0 none
    assert [RankTree(0, n).depth for n in (1, 2, 5, 6, 21, 22, 10_000)] == [0, 1, 1, 2, 2, 3, 7]
    with pytest.raises(ValueError, match="fanout"):
        RankTree(0, 4, fanout=1)
    with pytest.raises(ValueError, match="not in a tree"):
        RankTree(4, 4)


def _one_rank_never_comes(rank: int, world: int, tmp: Path, first: str) -> dict[str, Any]:
    group = SideGroup("test", SHORT)
    outcome: dict[str, Any] = {}
    if rank != 1:  # rank 1 takes another path: it never enters the agreement (but stays alive)
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as err:
            if first == "gather":
                group.all_gather_object(rank, op="checkpoint.agree")
            else:
                group.all_true(True, op="checkpoint.agree")
        outcome["waited"] = time.monotonic() - start
        outcome["message"] = str(err.value)
        start = time.monotonic()
        with pytest.raises(CollectiveError, match="not attempted"):  # broken: the next call fails at once
            group.all_true(True, op="again")
        outcome["second"] = time.monotonic() - start
    dist.barrier()  # the default group: rank 1 stays alive until the others are done
    return outcome


def _tensor_refused(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    group = SideGroup("test", timedelta(seconds=30))
    with pytest.raises(pickle.UnpicklingError, match="may not carry"):  # an agreement unpickles plain values only
        group.all_gather_object(dist_tensor(rank), op="objects")
    return {}


def test_an_agreement_refuses_objects_unless_asked_for_any_type(tmp_path: Path) -> None:
    run_ranks(_tensor_refused, 2, tmp_path)


@pytest.mark.parametrize("first", ["gather", "reduction"])
def test_a_rank_that_never_arrives_is_a_timeout_error_within_the_deadline(tmp_path: Path, first: str) -> None:
    results = run_ranks(_one_rank_never_comes, 3, tmp_path, first)
    for rank in (0, 2):
        assert SHORT.total_seconds() - 0.5 <= results[rank]["waited"] < SHORT.total_seconds() + 10
        assert "checkpoint.agree" in results[rank]["message"] and "rank" in results[rank]["message"]
        assert results[rank]["second"] < 1.0


def _a_rank_leaves(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    group = SideGroup("test", timedelta(seconds=60))
    # connected first: the suite's groups connect lazily, and a peer never reached is found at the deadline (the
    # test above); one that leaves after connecting closes its connections, which the others see at once
    assert group.all_true(True, op="hello")
    if rank == 1:
        dist.destroy_process_group()  # gone: its connections close
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg_store_after", rank=0, world_size=1)
        return {}
    start = time.monotonic()
    with pytest.raises(CollectiveError):
        group.all_true(True, op="agree")
    return {"waited": time.monotonic() - start}


def test_a_rank_that_is_gone_is_an_error_long_before_the_timeout(tmp_path: Path) -> None:
    results = run_ranks(_a_rank_leaves, 2, tmp_path)
    assert results[0]["waited"] < 30


def _deadline_passed(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    group = SideGroup("test", timedelta(seconds=30))
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="no time left"):
        group.all_true(True, op="late", deadline=Deadline(timedelta(0)))
    return {"waited": time.monotonic() - start}


def test_a_spent_deadline_fails_without_waiting(tmp_path: Path) -> None:
    assert all(r["waited"] < 1.0 for r in run_ranks(_deadline_passed, 2, tmp_path))


def test_without_peers_every_agreement_is_the_local_answer() -> None:
    group = SideGroup("solo", timedelta(seconds=1))
    assert not group.distributed and (group.rank, group.world_size) == (0, 1)
    assert group.all_gather_object({"a": 1}, op="x") == [{"a": 1}]
    assert group.all_true(False, op="x") is False and group.any_true(True, op="x") is True
    assert group.reduce_max(7, op="x") == 7
    assert group.exchange(b"abc", send_to=[], recv_from=[], op="x") == []
    with pytest.raises(ValueError, match="timeout must be > 0"):
        SideGroup("bad", timedelta(0))


def test_deadline_bounds_and_expires() -> None:
    now = [100.0]
    deadline = Deadline(timedelta(seconds=5), clock=lambda: now[0])
    assert deadline.bound(timedelta(seconds=60)) == timedelta(seconds=5)
    now[0] = 103.0
    assert deadline.bound(timedelta(seconds=1)) == timedelta(seconds=1)
    assert deadline.remaining() == timedelta(seconds=2) and not deadline.expired
    now[0] = 200.0
    assert deadline.expired and deadline.remaining() == timedelta(0)
    assert Deadline(None).remaining() is None and not Deadline(None).expired
