"""No stall under partial failure: five ways one rank could wait on peers that never come, each reproduced.

Each test breaks one thing on one rank (with the fault kit, or a store that stops answering) and asserts that every
rank returns within a bound far below the timeouts that used to apply (the 30-minute process-group default, a
300 s peer transfer, a 60 s store request): the bound is the test's own deadline, so a regression fails instead of
blocking CI.
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilience import CheckpointConfig
from lightning_resilience.checkpoint.errors import CheckpointWorkerError
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.remote import RemoteTier
from lightning_resilience.checkpoint.replication import PeerTier
from lightning_resilience.testing.faults import FaultPlan
from tests._ranks import run_ranks
from tests.checkpoint import _s3server
from tests.checkpoint._s3server import S3Endpoint, black_hole

own_s3 = _s3server.own_s3

DRAIN = timedelta(seconds=30)
DEADLINE_S = 90.0  # the whole multi-rank scenario; each assertion below is far tighter
PEER_TIMEOUT_S = 240.0  # longer than the test's deadline: a rank exchanging alone would block past it


def _state(rank: int, step: int) -> dict[str, Any]:
    return {"step": step, "w": torch.full((64,), float(rank * 1000 + step))}


def _manager(tiers: list[Any], **config: Any) -> CheckpointManager:
    mgr = CheckpointManager(tiers, CheckpointConfig(drain_timeout_s=DRAIN.total_seconds(), **config))
    mgr.setup()
    return mgr


def _peer(tmp: Path, every: int = 2) -> PeerTier:
    return PeerTier(tmp / "shm" / "node{node}", every_n_steps=every, keep=3, ranks_per_node=1, timeout_s=PEER_TIMEOUT_S)


# ---------------------------------------------------------------- 1. collective emergency save, one rank cannot write
def _emergency_one_rank_busy(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    plan = FaultPlan().fail_at(1, 4, "tier.local.write", "hang")  # rank 1's persist of step 4 never finishes
    local = plan.instrument(LocalTier(tmp / "ckpt", every_n_steps=2, keep=3))
    mgr = _manager([MemoryTier(keep=2), local])
    for step in range(1, 5):
        mgr.on_step(step, lambda step=step: _state(rank, step))
        if step < 4:  # step 4's persist starts on both ranks (no deferral), and hangs on rank 1
            assert mgr.wait(DRAIN)
    start = time.monotonic()
    saved = mgr.emergency_save(timedelta(seconds=3), collective=True)
    elapsed = time.monotonic() - start
    plan.release()
    mgr.close(DRAIN)
    return {"saved": saved, "elapsed": elapsed}


def test_collective_emergency_save_returns_on_every_rank_when_one_rank_cannot_write(tmp_path: Path) -> None:
    """Rank 1's worker is stuck in a write: it cannot save, yet it still takes part in the agreement, so rank 0 is
    not left waiting in it (before: rank 1 returned early and rank 0 waited on a side group without a timeout)."""
    r0, r1 = run_ranks(_emergency_one_rank_busy, 2, tmp_path, deadline_s=DEADLINE_S)
    assert r0["saved"] == 4 and r1["saved"] is None, (r0, r1)
    assert r0["elapsed"] < 20 and r1["elapsed"] < 20, (r0, r1)


# ---------------------------------------------------------------- 2. the peer exchange is entered by every rank
def _peer_local_bug(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    plan = FaultPlan().fail_at(1, 4, "local.write_shard", "error")  # a bug (not an I/O error) in rank 1's commit
    with plan.armed():
        mgr = _manager([MemoryTier(keep=2), _peer(tmp)])
        outcome: dict[str, Any] = {}
        for step in range(1, 4):
            mgr.on_step(step, lambda step=step: _state(rank, step))
            assert mgr.wait(DRAIN)
        mgr.on_step(4, lambda: _state(rank, 4))
        start = time.monotonic()
        try:
            outcome["idle"] = mgr.wait(DRAIN)
        except CheckpointWorkerError as err:
            outcome["error"] = str(err)
        outcome["elapsed"] = time.monotonic() - start
        mgr.close(DRAIN)
    return outcome


def test_a_bug_in_one_rank_s_local_commit_does_not_skip_its_peer_exchange(tmp_path: Path) -> None:
    """Rank 1's local commit raises a RuntimeError inside the peer tier's write: it still exchanges (sending
    "nothing") and then reports the error; rank 0 finishes at once (before: rank 1 skipped the exchange and rank 0
    waited for the peer transfer's timeout)."""
    r0, r1 = run_ranks(_peer_local_bug, 2, tmp_path, deadline_s=DEADLINE_S)
    assert r0.get("idle") is True and r0["elapsed"] < 30, r0
    assert "InjectedError" in r1.get("error", ""), r1


def _flush_one_rank_lacks(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    plan = FaultPlan().fail_at(1, 4, "local.write_shard", "raise")  # rank 1's own copy of step 4 is not committed
    with plan.armed():
        peer = _peer(tmp)
        mgr = _manager([MemoryTier(keep=2), peer])
        for step in range(1, 5):
            mgr.on_step(step, lambda step=step: _state(rank, step))
            assert mgr.wait(DRAIN)
        before = peer.list_steps()
        start = time.monotonic()
        mgr.flush(4, lambda: _state(rank, 4))
        elapsed = time.monotonic() - start
        after = peer.list_steps()
        mgr.close(DRAIN)
    return {"before": before, "after": after, "elapsed": elapsed}


def test_flush_writes_a_peer_tier_on_every_rank_when_one_rank_lacks_the_step(tmp_path: Path) -> None:
    """Only rank 1 lacks step 4 in the peer tier: the ranks agree that the tier is due, and both exchange (before:
    each rank chose on its own, and rank 1 exchanged alone until the transfer timeout)."""
    r0, r1 = run_ranks(_flush_one_rank_lacks, 2, tmp_path, deadline_s=DEADLINE_S)
    assert 4 in r0["before"] and 4 not in r1["before"], (r0, r1)
    assert 4 in r0["after"] and 4 in r1["after"], (r0, r1)
    assert r0["elapsed"] < 30 and r1["elapsed"] < 30, (r0, r1)


# ---------------------------------------------------------------- 3. nothing consumed before the agreement
def _ram_step_refused(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    memory = MemoryTier(keep=2)
    FaultPlan().fail_at(1, 6, "tier.memory.[ht]*").instrument(memory)  # rank 1 cannot produce step 6, once
    mgr = _manager([memory])
    for step in range(1, 7):
        mgr.on_step(step, lambda step=step: _state(rank, step))
    first = mgr.restore()
    held = memory.list_steps()
    second = mgr.restore(6)  # rank 1's fault was transient: step 6 is loadable everywhere now
    mgr.close(DRAIN)
    assert first is not None and second is not None
    return {"first": first.step, "held_after_first": held, "second": second.step, "w": second.state["w"][0].item()}


def test_a_ram_snapshot_survives_a_step_another_rank_refuses(tmp_path: Path) -> None:
    """Rank 1 cannot load step 6, so both restore step 5; rank 0's RAM copy of step 6 is still there afterwards
    (before: it was handed over before the agreement and lost), and a later restore of step 6 succeeds."""
    r0, r1 = run_ranks(_ram_step_refused, 2, tmp_path, deadline_s=DEADLINE_S)
    assert r0["first"] == r1["first"] == 5, (r0, r1)
    assert r0["held_after_first"] == [6], r0
    assert (r0["second"], r1["second"]) == (6, 6) and (r0["w"], r1["w"]) == (6.0, 1006.0), (r0, r1)


# ---------------------------------------------------------------- 4. deadlines inside tier writes
def _hung_store_tier(s3: S3Endpoint, every: int, timeout_s: float = 45.0) -> RemoteTier:
    options = s3.storage_options(
        config_kwargs={"retries": {"total_max_attempts": 1}, "connect_timeout": 60, "read_timeout": 60}
    )
    tier = RemoteTier(s3.url(), every_n_steps=every, keep=2, storage_options=options, retries=0, timeout_s=timeout_s)
    tier.fs.retries = 1  # s3fs's own retry loop would wait on top of the tier's
    return tier


def _in_thread(fn: Any, limit_s: float) -> float:
    """Run ``fn`` on a thread; the seconds it took, or ``inf`` if it did not return within ``limit_s``."""
    done = threading.Event()
    start = time.monotonic()
    thread = threading.Thread(target=lambda: (fn(), done.set()), daemon=True)
    thread.start()
    return time.monotonic() - start if done.wait(limit_s) else float("inf")


def test_an_emergency_save_stops_at_its_deadline_inside_a_remote_upload(own_s3: S3Endpoint) -> None:
    """The store stops answering during an emergency save with a 2 s budget: the upload gives up at the budget, not
    at the tier's 45 s request timeout (before: the deadline was checked only between tiers)."""
    mgr = _manager([MemoryTier(keep=1), _hung_store_tier(own_s3, every=1000)])
    mgr.on_step(1, lambda: _state(0, 1))
    with black_hole(own_s3):
        outcome: dict[str, Any] = {}
        took = _in_thread(lambda: outcome.update(saved=mgr.emergency_save(timedelta(seconds=2))), limit_s=20)
    assert took < 15, f"emergency save took {took:.1f}s with a 2s budget"
    assert outcome["saved"] is None and mgr.stats.tiers["remote"].failures == 1
    mgr.close(DRAIN)


# ---------------------------------------------------------------- 5. remote listing off the training thread
def test_the_training_thread_never_waits_on_a_remote_listing(own_s3: S3Endpoint) -> None:
    """At a persist cadence the agreement lists every tier; with the store hung, the remote tier answers from what
    it knows at once (before: an ls and an info per step ran on the training thread, each up to the timeout)."""
    # a request waits up to 12 s: far above the bound on on_step, short enough for the background upload to end
    mgr = _manager([MemoryTier(keep=1), _hung_store_tier(own_s3, every=2, timeout_s=12.0)])
    assert mgr.on_step(2, lambda: _state(0, 2)) and mgr.wait(DRAIN)  # committed while the store answers
    with black_hole(own_s3):
        took = _in_thread(lambda: mgr.on_step(4, lambda: _state(0, 4)), limit_s=20)
        assert took < 5, f"on_step blocked {took:.1f}s on a hung store"
        assert mgr.steps()["remote"] == [2]
        mgr.close(timedelta(seconds=60))  # the upload of step 4 waits for the store in the background
    assert mgr.stats.tiers["remote"].failures == 1


# ---------------------------------------------------------------- 6. a persist failure stops every rank together
def _persist_bug_on_one_rank(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    plan = FaultPlan().fail_at(1, 4, "tier.local.write", "error")  # a bug (not an I/O error) in rank 1's persist
    local = plan.instrument(LocalTier(tmp / "ckpt", every_n_steps=2, keep=3))
    mgr = _manager([MemoryTier(keep=2), local], collective_timeout_s=PEER_TIMEOUT_S)
    outcome: dict[str, Any] = {}
    for step in range(1, 7):
        start = time.monotonic()
        try:
            mgr.on_step(step, lambda step=step: _state(rank, step))
        except CheckpointWorkerError as err:
            outcome.update(step=step, error=str(err), elapsed=time.monotonic() - start)
            break
        mgr.wait(DRAIN, hold_failure=True)  # the persist of this step is done (a caller about to agree)
    with contextlib.suppress(CheckpointWorkerError):
        mgr.close(DRAIN)
    return outcome


def test_a_persist_failure_on_one_rank_stops_every_rank_at_the_same_agreement(tmp_path: Path) -> None:
    """Rank 1's persist of step 4 fails with a bug: it is carried into the next persist agreement (step 6), where
    both ranks raise at once (before: rank 1 raised at step 5, before any agreement, and rank 0 waited in the
    agreement of step 6 for ``checkpoint.collective_timeout_s``)."""
    r0, r1 = run_ranks(_persist_bug_on_one_rank, 2, tmp_path, deadline_s=DEADLINE_S)
    assert r0.get("step") == r1.get("step") == 6, (r0, r1)
    assert "rank(s) [1]" in r0["error"] and "InjectedError" in r1["error"], (r0, r1)
    assert r0["elapsed"] < 20 and r1["elapsed"] < 20, (r0, r1)


@pytest.mark.parametrize("collective", [True, False])
def test_emergency_save_without_peers_is_the_local_answer(tmp_path: Path, collective: bool) -> None:
    """On one process both modes save the newest RAM step to every persistent tier, peer tier included."""
    mgr = _manager([MemoryTier(keep=2), LocalTier(tmp_path / "l", every_n_steps=100), _peer(tmp_path, every=100)])
    for step in range(1, 4):
        mgr.on_step(step, lambda step=step: _state(0, step))
    assert mgr.emergency_save(timedelta(seconds=30), collective=collective) == 3
    assert mgr.steps()["local"] == [3] and mgr.steps()["peer"] == [3]
    mgr.close(DRAIN)
