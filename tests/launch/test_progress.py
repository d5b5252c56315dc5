"""The newest committed step, as the launcher reads it between attempts."""

from __future__ import annotations

from pathlib import Path

from lightning_resilience.checkpoint.format import Manifest
from lightning_resilience.launch.progress import newest_committed_step, read_iteration_file


def _shard(root: Path, step: int, rank: int, world: int = 2) -> None:
    shard = root / f"step_{step:012d}" / f"rank_{rank:05d}"
    shard.mkdir(parents=True)
    (shard / "manifest.json").write_text(Manifest(step, rank, world, tensors={}, files={}).to_json())


def test_a_step_counts_once_every_rank_committed_it(tmp_path: Path) -> None:
    tier = tmp_path / "ckpt" / "local"
    assert newest_committed_step(tmp_path, local_ranks=2) is None
    for rank in (0, 1):
        _shard(tier, 4, rank)
    _shard(tier, 8, 0)  # rank 1 died before committing step 8
    assert newest_committed_step(tmp_path, local_ranks=2) == 4
    (tier / "step_000000000008" / ".rank_00001.tmp-1a2b").mkdir()  # ... and left its temporary
    assert newest_committed_step(tmp_path, local_ranks=2) == 4
    (tier / "step_000000000012" / "rank_00000").mkdir(parents=True)  # a shard without its manifest
    _shard(tier, 12, 1)
    assert newest_committed_step(tmp_path, local_ranks=2) == 4


def test_the_newest_of_several_tiers_and_a_node_local_view(tmp_path: Path) -> None:
    for rank in (0, 1):
        _shard(tmp_path / "ckpt" / "local", 10, rank)
    _shard(tmp_path / "ckpt" / "delta", 12, 0, world=4)  # a node-local disk of a 4-rank job: only ranks 0 and 1 here
    _shard(tmp_path / "ckpt" / "delta", 12, 1, world=4)
    assert newest_committed_step(tmp_path, local_ranks=2) == 12
    assert newest_committed_step(tmp_path, local_ranks=4) == 10


def test_iteration_file(tmp_path: Path) -> None:
    path = tmp_path / "latest_checkpointed_iteration.txt"
    assert read_iteration_file(path) is None
    path.write_text("1200\n")
    assert read_iteration_file(path) == 1200
    path.write_text("not a number")
    assert read_iteration_file(path) is None
