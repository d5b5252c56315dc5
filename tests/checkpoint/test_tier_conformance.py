"""Every tier passes the same suite: protocol, commit atomicity, listing, corrupt-read detection, retention,
concurrent writers, deadline.

The tiers: memory (process or shared), local, delta-local, peer (one process: no exchange), remote on S3 (moto on
loopback). A tier that cannot meet a property by its nature (a RAM tier has no bytes to rot) says so in its case,
and the test says why it does not apply.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from lightning_resilience.checkpoint.delta_tier import DeltaLocalTier
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.layout import rank_dirname, step_dirname
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.remote import RemoteTier
from lightning_resilience.checkpoint.replication import PeerTier
from lightning_resilience.checkpoint.retention import apply_retention
from lightning_resilience.checkpoint.tier import CollectiveTier, Durability, RamTier, Tier, TierIdentity, Written
from lightning_resilience.collective import Deadline
from lightning_resilience.testing.faults import FaultPlan
from tests.checkpoint import _s3server
from tests.checkpoint._s3server import S3Endpoint
from tests.checkpoint.conftest import assert_tensors_equal, data_file, flip_byte, make_snapshot

s3_server = _s3server.s3_server
s3 = _s3server.s3


@dataclass
class Case:
    """One tier under test and how to reach below it."""

    make: Callable[[int, int], Tier]
    """A tier bound as ``(rank, world_size)`` (a new object over the same storage each call)."""
    fault_point: str | None
    """The internal point where a write can fail half-way (see ``lightning_resilience.testing.faults.POINTS``)."""
    corrupt: Callable[[int, int], None] | None
    """Flip one byte of ``(step, rank)``'s data in storage; None for a tier without stored bytes."""
    shared: bool = True
    """Several processes (ranks) write into the same storage."""


def _directory_case(tmp: Path, cls: Callable[..., Tier], point: str = "local.write_shard", **kwargs: Any) -> Case:
    root = tmp / "tier"

    def make(rank: int, world: int) -> Tier:
        per_node = {"ranks_per_node": world} if cls is PeerTier else {}  # the ranks of one node share its directory
        tier = cls(root, every_n_steps=1, keep=3, **per_node, **kwargs)
        tier.bind(TierIdentity(rank, world))
        return tier

    def corrupt(step: int, rank: int) -> None:
        flip_byte(data_file(root / step_dirname(step) / rank_dirname(rank)))

    return Case(make, point, corrupt)


def _remote_case(s3: S3Endpoint) -> Case:
    def make(rank: int, world: int) -> Tier:
        tier = RemoteTier(s3.url("conf"), every_n_steps=1, keep=3, storage_options=s3.storage_options(), retries=0)
        tier.fs.retries = 1
        tier.bind(TierIdentity(rank, world))
        return tier

    def corrupt(step: int, rank: int) -> None:
        client = s3.server.client()
        key = f"conf/{step_dirname(step)}/{rank_dirname(rank)}/__0_0.distcp"
        data = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
        data[len(data) // 2] ^= 0xFF
        client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))

    return Case(make, "remote.upload", corrupt)


def _memory_case(shm_dir: Path | None = None) -> Case:
    def make(rank: int, world: int) -> Tier:
        shared = {"shared_memory": True, "shm_dir": str(shm_dir), "run_id": "conformance"} if shm_dir else {}
        tier = MemoryTier(keep=3, **shared)
        tier.bind(TierIdentity(rank, world))
        return tier

    return Case(make, None, None, shared=False)


KINDS = ["memory", "shared-memory", "local", "delta", "peer", "remote"]


@pytest.fixture(params=KINDS)
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Case]:
    kind = request.param
    if kind == "memory":
        yield _memory_case()
    elif kind == "shared-memory":
        yield _memory_case(tmp_path / "shm")
    elif kind == "local":
        yield _directory_case(tmp_path, LocalTier)
    elif kind == "delta":
        yield _directory_case(tmp_path, DeltaLocalTier, "delta.seal_shard", full_every=3)
    elif kind == "peer":
        yield _directory_case(tmp_path, PeerTier)
    else:
        yield _remote_case(request.getfixturevalue("s3"))


def test_implements_the_protocol(case: Case) -> None:
    tier = case.make(0, 1)
    assert isinstance(tier, Tier) and isinstance(tier.durability, Durability)
    assert isinstance(tier, RamTier) == tier.ram
    assert tier.ram or tier.durability is not Durability.process
    assert isinstance(tier, CollectiveTier) == tier.collective
    written = tier.write(make_snapshot(1))
    assert isinstance(written, Written) and written.step == 1 and written.nbytes > 0


def test_listing_reading_and_deleting(case: Case) -> None:
    tier = case.make(0, 1)
    assert tier.list_steps() == []
    for step in (3, 1, 2):
        tier.write(make_snapshot(step))
    assert tier.list_steps() == [1, 2, 3]
    assert_tensors_equal(tier.read(2).tensors, make_snapshot(2).tensors)
    assert tier.read(3).meta == make_snapshot(3).meta
    tier.delete(3)
    assert tier.list_steps() == [1, 2]
    with pytest.raises(CheckpointCorruptError):
        tier.read(3)
    if case.shared:  # a new process over the same storage sees the same committed steps
        assert case.make(0, 1).list_steps() == [1, 2]


def test_a_write_that_fails_half_way_commits_nothing(case: Case) -> None:
    if case.fault_point is None:
        pytest.skip("a RAM write is one in-memory copy: there is no half-way")
    tier = case.make(0, 1)
    tier.write(make_snapshot(1))
    plan = FaultPlan().fail_at(None, 2, case.fault_point)
    with plan.armed(), pytest.raises(OSError):
        tier.write(make_snapshot(2))
    assert plan.fired, "the fault point was never reached"
    assert tier.list_steps() == [1]
    assert case.make(0, 1).list_steps() == [1]  # nor does a fresh process see step 2
    assert_tensors_equal(tier.read(1).tensors, make_snapshot(1).tensors)
    tier.write(make_snapshot(2))  # and the step can be written again
    assert tier.list_steps() == [1, 2]


def test_a_corrupt_shard_is_refused_on_read(case: Case) -> None:
    if case.corrupt is None:
        pytest.skip("a RAM tier holds live buffers, not stored bytes that can rot")
    tier = case.make(0, 1)
    tier.write(make_snapshot(1))
    case.corrupt(1, 0)
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        case.make(0, 1).read(1)


def test_retention_keeps_the_newest_and_the_protected_step(case: Case) -> None:
    if not case.shared:
        pytest.skip("a RAM tier evicts beyond its keep by itself; retention by agreement is for persistent tiers")
    tier = case.make(0, 1)
    for step in range(1, 6):
        tier.write(make_snapshot(step))
        apply_retention(tier, protected=1)
    steps = tier.list_steps()
    assert {1, 3, 4, 5} <= set(steps), steps
    assert len(steps) <= tier.keep + 2, steps  # at most one more: a delta tier keeps the base its deltas need
    for step in steps:
        assert_tensors_equal(tier.read(step).tensors, make_snapshot(step).tensors)


def test_concurrent_writers_of_one_step_each_commit_their_own_shard(case: Case) -> None:
    if not case.shared:
        pytest.skip("a RAM tier belongs to one process: no other rank writes into it")
    tiers = [case.make(rank, 2) for rank in range(2)]
    errors: list[BaseException] = []
    start = threading.Barrier(2, timeout=30)

    def write(tier: Tier) -> None:
        try:
            start.wait()
            for step in (1, 2, 3):
                tier.write(make_snapshot(step))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=write, args=(t,)) for t in tiers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for rank in range(2):
        again = case.make(rank, 2)
        assert again.list_steps() == [1, 2, 3]
        assert_tensors_equal(again.read(3).tensors, make_snapshot(3).tensors)
    tiers[0].delete(3)  # deleting one rank's shard leaves the other's
    assert case.make(0, 2).list_steps() == [1, 2] and case.make(1, 2).list_steps() == [1, 2, 3]


def test_a_write_past_its_deadline_fails_and_commits_nothing(case: Case) -> None:
    tier = case.make(0, 1)
    tier.write(make_snapshot(1))
    with pytest.raises(OSError, match="deadline"):  # an OSError: counted as a failed write, training goes on
        tier.write(make_snapshot(2), Deadline(timedelta(0)))
    assert tier.list_steps() == [1]
