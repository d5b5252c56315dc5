"""PeerTier: shards in node RAM, replicated across nodes; the ranks of a lost node restore from their peers."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_resilience.checkpoint import filesystems
from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.local import LocalTier, step_dirname
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.replication import PeerTier, ReplicaPlacement, _pack, _unpack
from lightning_resilience.config import PeerTierConfig
from tests._ranks import run_ranks
from tests.checkpoint.conftest import assert_state_equal, make_state, state_at

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------------------------------- placement
def test_ring_placement_puts_copies_on_other_nodes() -> None:
    p = ReplicaPlacement(world_size=8, ranks_per_node=2, replicas=2)
    assert p.num_nodes == 4
    assert p.targets(0) == [2, 4] and p.sources(0) == [6, 4]
    assert p.targets(7) == [1, 3] and p.sources(7) == [5, 3]
    for rank in range(8):
        assert all(p.node_of(t) != p.node_of(rank) for t in p.targets(rank))
        assert all(rank in p.targets(s) for s in p.sources(rank))


def test_replicas_are_capped_by_the_number_of_other_nodes() -> None:
    assert ReplicaPlacement(world_size=4, ranks_per_node=2, replicas=3).replicas == 1
    assert ReplicaPlacement(world_size=2, ranks_per_node=2, replicas=1).targets(0) == []
    with pytest.raises(ValueError, match="ranks_per_node must divide"):
        ReplicaPlacement(world_size=4, ranks_per_node=3, replicas=1)


def test_config_names_the_bad_key() -> None:
    with pytest.raises(ValueError, match=r"tiers\.peer\.replicas must be >= 0"):
        PeerTierConfig(replicas=-1)
    with pytest.raises(ValueError, match=r"tiers\.peer\.every_n_steps must be >= 1"):
        PeerTierConfig(every_n_steps=-1)
    with pytest.raises(ValueError, match=r"tiers\.peer\.timeout_s must be > 0"):
        PeerTierConfig(timeout_s=0)
    assert isinstance(PeerTierConfig(path="/tmp/x").build(), PeerTier)


# ------------------------------------------------------------------------------------------------ packing
def test_pack_round_trip_and_unsafe_names(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "a", every_n_steps=1)
    manager = CheckpointManager([tier])
    manager.setup()
    manager.on_step(3, state_at(3))
    assert manager.wait()
    manager.close()
    payload = _pack(tier.shard_dir(3))
    copy = tmp_path / "b" / step_dirname(3) / "rank_00000"
    _unpack(payload, copy)
    restored = LocalTier(tmp_path / "b").read(3)
    assert_state_equal(CheckpointManager([LocalTier(tmp_path / "b")]).restore().state, make_state(3))  # type: ignore[union-attr]
    assert restored.step == 3
    evil = b'[["../escape", 1]]'
    with pytest.raises(OSError, match="unsafe file"):
        _unpack(len(evil).to_bytes(8, "little") + evil + b"x", tmp_path / "c")
    with pytest.raises(OSError, match="its index accounts"):
        _unpack(payload + b"trailing", tmp_path / "d")


def test_single_process_keeps_a_node_ram_copy(tmp_path: Path, managers: list[CheckpointManager]) -> None:
    """Without peers the tier is a tmpfs copy that outlives the process (a torchrun restart)."""
    tier = PeerTier(tmp_path / "node{node}", every_n_steps=1, keep=2)
    manager = CheckpointManager([tier])
    manager.setup()
    managers.append(manager)
    for step in range(1, 4):
        manager.on_step(step, state_at(step))
        assert manager.wait()
    assert tier.root == tmp_path / "node0"
    assert tier.list_steps() == [2, 3] and tier.inventory() == {0: [2, 3]}
    assert tier.sent_bytes == 0
    fresh = CheckpointManager([PeerTier(tmp_path / "node{node}")])
    managers.append(fresh)
    fresh.setup()
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (3, "peer")


# ---------------------------------------------------------------------------------------- four ranks, two nodes
def _state(rank: int, step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank * 100 + step)
    return {"model": {"w": torch.randn(64, 32, generator=gen)}, "rank": rank, "step": step}


def _tiers(tmp: Path) -> list[Any]:
    # one machine stands in for two nodes of two ranks: '{node}' gives each its own RAM and disk directories
    return [
        MemoryTier(every_n_steps=1, keep=2),
        PeerTier(tmp / "shm" / "node{node}", every_n_steps=1, keep=2, ranks_per_node=2, timeout_s=60),
        LocalTier(tmp / "disk" / f"node{dist.get_rank() // 2}", every_n_steps=3, keep=2),
    ]


def _run_and_lose_node(rank: int, tmp: Path, corrupt_replica: bool = False) -> dict[str, Any]:
    tiers = _tiers(tmp)
    manager = CheckpointManager(tiers, CheckpointConfig(drain_timeout_s=60))
    manager.setup()
    for step in range(1, 8):
        manager.on_step(step, lambda step=step: _state(rank, step))
        assert manager.wait()
    peer: PeerTier = tiers[1]
    manager.close()
    dist.barrier()  # every rank's persists (and so the replicas it received) are done
    before = {"inventory": {str(k): v for k, v in peer.inventory().items()}, "sent": peer.sent_bytes}
    dist.barrier()
    if rank == 2:  # node 1 is lost: its RAM and its local disk with it
        shutil.rmtree(tmp / "shm" / "node1")
        shutil.rmtree(tmp / "disk" / "node1")
    if rank == 0 and corrupt_replica:  # the copy of rank 2's newest shard that node 0 holds has rotted
        (data,) = (tmp / "shm" / "node0" / step_dirname(7) / "rank_00002").glob("*.distcp")
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    dist.barrier()
    tiers = _tiers(tmp)  # the restarted job: nothing in RAM of the processes
    fresh = CheckpointManager(tiers, CheckpointConfig(drain_timeout_s=60))
    fresh.setup()
    restored = fresh.restore()
    fresh.close()
    assert restored is not None
    return {
        **before,
        "step": restored.step,
        "tier": restored.tier,
        "state_ok": bool(torch.equal(restored.state["model"]["w"], _state(rank, restored.step)["model"]["w"])),
        "recovered": tiers[1].recovered,
        "skipped": fresh.stats.skipped_corrupt,
    }


def _scenario_node_loss(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    return _run_and_lose_node(rank, tmp)


def _scenario_corrupt_replica(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    return _run_and_lose_node(rank, tmp, corrupt_replica=True)


def test_lost_node_restores_the_newest_step_from_peer_ram(tmp_path: Path) -> None:
    """Node 1 (ranks 2, 3) loses RAM and disk: all ranks resume at step 7 from peer copies, not disk step 6."""
    results = run_ranks(_scenario_node_loss, 4, tmp_path)
    for rank, res in enumerate(results):
        node_ranks = ["0", "1", "2", "3"]
        assert sorted(res["inventory"]) == node_ranks and all(v == [6, 7] for v in res["inventory"].values()), res
        assert res["sent"] > 0
        assert (res["step"], res["tier"], res["state_ok"]) == (7, "peer", True), (rank, res)
        expected = [[7, rank, 0], [6, rank, 0]] if rank >= 2 else []  # the lowest rank holding a copy sends it
        assert res["recovered"] == expected, (rank, res["recovered"])


def test_corrupt_peer_copy_falls_back_to_the_previous_step(tmp_path: Path) -> None:
    """Rank 2's only surviving copy of step 7 is corrupt: every rank restores step 6, and rank 2 says why."""
    results = run_ranks(_scenario_corrupt_replica, 4, tmp_path)
    for rank, res in enumerate(results):
        assert (res["step"], res["tier"], res["state_ok"]) == (6, "peer", True), (rank, res)
    assert any("step 7" in s and "checksum" in s for s in results[2]["skipped"]), results[2]["skipped"]


def test_spread_placement_spaces_copies_evenly() -> None:
    p = ReplicaPlacement(world_size=16, ranks_per_node=2, replicas=1, placement="spread")
    assert [p.node_of(t) for t in p.targets(0)] == [4]  # 8 nodes: the copy sits half-way around
    p3 = ReplicaPlacement(world_size=16, ranks_per_node=2, replicas=3, placement="spread")
    assert [p3.node_of(t) for t in p3.targets(3)] == [3, 5, 7]
    for rank in range(16):
        assert all(rank in p3.targets(s) for s in p3.sources(rank))
    with pytest.raises(ValueError, match=r"tiers\.peer\.placement must be one of \['ring', 'spread'\]"):
        PeerTierConfig(placement="random")


def test_a_peer_path_on_a_disk_is_used_and_said_to_be_one(
    tmp_path: Path, managers: list[CheckpointManager], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The peer tier's node copies belong in RAM: a path on a disk filesystem (the mount table says which) is used as
    set, and said with the setting and the filesystem's type; a tmpfs is not."""
    (tmp_path / "ram").mkdir()
    table = tmp_path / "mountinfo"
    table.write_text(f"22 1 0:1 / / rw - ext4 /dev/vda rw\n25 22 0:23 / {tmp_path / 'ram'} rw - tmpfs tmpfs rw\n")
    monkeypatch.setattr(filesystems, "MOUNTINFO", table)
    for where, said in ((tmp_path / "disk", True), (tmp_path / "ram", False)):
        caplog.clear()
        tier = PeerTier(where / "node{node}", every_n_steps=1, keep=2)
        manager = CheckpointManager([tier])
        with caplog.at_level(logging.WARNING):
            manager.setup()
        managers.append(manager)
        warned = [r.getMessage() for r in caplog.records if "not in RAM" in r.getMessage()]
        assert len(warned) == said and all(
            w.startswith(f"tiers.peer.path={where / 'node0'} is on a ext4") for w in warned
        )
        manager.on_step(1, state_at(1))
        assert manager.wait() and tier.list_steps() == [1]  # used either way
