"""Resharding in one process: hand-laid shards written through ``LocalTier`` pin the layout math (a rank's slice of a
DTensor, uneven and empty pieces, tied tensors, a checkpoint without its mesh's shape), the plan's refusals before
anything is read, and checksum detection. ``test_reshard.py`` restores real multi-rank checkpoints on another world
size."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from lightning_resilience.checkpoint import reshard
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.local import LocalTier, step_dirname
from lightning_resilience.checkpoint.reshard import (
    ReshardError,
    local_slice,
    plan_reshard,
    reshardable_steps,
    restore_resharded,
)
from lightning_resilience.checkpoint.reshard import load as reshard_load
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tier import TierIdentity
from lightning_resilience.checkpoint.tree import placement_from_text
from tests.checkpoint.conftest import data_file, flip_byte, named_tensor, rewrite_manifest

pytestmark = pytest.mark.timeout(120)

STEP = 8
"""The step every hand-laid checkpoint is written at."""


def _layout(
    name: str, shape: tuple[int, ...], placements: tuple[str, ...], mesh: tuple[int, ...], coord: tuple[int, ...]
) -> dict[str, Any]:
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * shape[d + 1]
    return {
        "DT": {
            "local": name,
            "mesh": ["dp"] if len(mesh) == 1 else ["rep", "shard"],
            "placements": list(placements),
            "shape": list(shape),
            "stride": stride,
            "mesh_shape": list(mesh),
            "coord": list(coord),
        }
    }


def _write_sharded(
    root: Path,
    world: int,
    tensors: Mapping[str, tuple[torch.Tensor, tuple[str, ...]]],
    *,
    mesh: tuple[int, ...] | None = None,
    edit: Callable[[int, dict[str, Any], dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """Write ``world`` shards of a step as the ranks of a sharded job would, each through its own LocalTier."""
    mesh = mesh or (world,)
    for rank in range(world):
        coord = tuple(reshard._unravel(rank, mesh))
        skeleton: dict[str, Any] = {"d": {"rank": rank}}
        flat: dict[str, torch.Tensor] = {"plain": torch.arange(3.0)}
        skeleton["d"]["plain"] = {"T": "plain"}
        for name, (full, placements) in tensors.items():
            offsets, sizes = local_slice(full.shape, mesh, coord, placements)
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            flat[name] = full[index].clone()
            skeleton["d"][name] = _layout(name, tuple(full.shape), placements, mesh, coord)
        if edit is not None:
            edit(rank, skeleton, flat)
        tier = LocalTier(root, every_n_steps=1)
        tier.bind(TierIdentity(rank, world))
        tier.write(StagedSnapshot(STEP, skeleton, flat, {}))
    return root / step_dirname(STEP)


@pytest.mark.parametrize("shape", [(7, 3), (1, 5), (9,), (4, 6), (5, 0)])
@pytest.mark.parametrize("mesh", [(1,), (3,), (4,), (2, 2), (2, 3)])
def test_local_slice_matches_dtensor_chunking(shape: tuple[int, ...], mesh: tuple[int, ...]) -> None:
    placements_options: list[tuple[str, ...]] = (
        [("S0",), ("R",), (f"S{len(shape) - 1}",)] if len(mesh) == 1 else [("R", "S0"), ("S0", "S0")]
    )
    if len(mesh) == 2 and len(shape) == 2:
        placements_options.append(("S0", "S1"))
    for placements in placements_options:
        for rank in range(int(torch.tensor(mesh).prod())):
            coord = reshard._unravel(rank, mesh)
            sizes, offsets = _compute_local_shape_and_global_offset(
                shape, mesh, list(coord), [placement_from_text(p) for p in placements]
            )
            assert local_slice(shape, mesh, coord, placements) == (tuple(offsets), tuple(sizes)), (placements, coord)


@pytest.mark.parametrize("old, new", [(4, 1), (4, 3), (3, 4), (2, 8)])
def test_uneven_and_empty_pieces_reassemble_exactly(tmp_path: Path, old: int, new: int) -> None:
    full = {"w": named_tensor("w", (7, 3)), "c": named_tensor("c", (2, 5)), "r": named_tensor("r", (3,))}
    step_dir = _write_sharded(
        tmp_path, old, {"w": (full["w"], ("S0",)), "c": (full["c"], ("S1",)), "r": (full["r"], ("R",))}
    )
    parts: dict[str, list[torch.Tensor]] = {"w": [], "c": []}
    plan = plan_reshard(step_dir, new)
    for rank in range(new):
        res = restore_resharded(tmp_path, STEP, TierIdentity(rank, new), plan=plan)
        assert res.state["rank"] == rank % old
        assert torch.equal(res.state["r"], full["r"])
        assert torch.equal(res.state["plain"], torch.arange(3.0))
        parts["w"].append(res.state["w"])
        parts["c"].append(res.state["c"])
    assert torch.equal(torch.cat(parts["w"], 0), full["w"])
    assert torch.equal(torch.cat(parts["c"], 1), full["c"])


def test_tied_dtensors_come_back_tied_with_both_layouts_moved(tmp_path: Path) -> None:
    """Two DTensors sharing one local tensor (tied weights) are one entry; both skeleton nodes get the new layout."""
    full = named_tensor("w", (6, 2))

    def tie(rank: int, skeleton: dict[str, Any], flat: dict[str, torch.Tensor]) -> None:
        skeleton["d"]["head"] = json.loads(json.dumps(skeleton["d"]["w"]))

    _write_sharded(tmp_path, 4, {"w": (full, ("S0",))}, edit=tie)
    seen: list[Mapping[str, Any]] = []

    def rebuild(local: torch.Tensor, layout: Mapping[str, Any]) -> torch.Tensor:
        seen.append(dict(layout))
        return local

    parts = []
    for rank in range(2):
        state = restore_resharded(tmp_path, STEP, TierIdentity(rank, 2), rebuild_dtensor=rebuild).state
        assert state["head"] is state["w"]
        parts.append(state["w"])
    assert torch.equal(torch.cat(parts), full)
    assert [(s["mesh_shape"], s["coord"]) for s in seen] == [([2], [0])] * 2 + [([2], [1])] * 2


def test_checkpoint_without_recorded_mesh_shape_reshards_a_1d_mesh(tmp_path: Path) -> None:
    """Shards written before ``mesh_shape``/``coord`` were recorded: a 1-D mesh over the job is assumed, and the
    recorded piece shapes must agree with it."""
    full = named_tensor("w", (9, 2))

    def strip(rank: int, skeleton: dict[str, Any], flat: dict[str, torch.Tensor]) -> None:
        del skeleton["d"]["w"]["DT"]["mesh_shape"], skeleton["d"]["w"]["DT"]["coord"]

    _write_sharded(tmp_path, 4, {"w": (full, ("S0",))}, edit=strip)
    parts = [restore_resharded(tmp_path, STEP, TierIdentity(r, 2)).state["w"] for r in range(2)]
    assert torch.equal(torch.cat(parts), full)


@pytest.fixture
def nothing_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records any tensor-data read or data-file validation; a pre-flight refusal must leave it empty."""
    reads: list[str] = []
    original_read = FileSystemReader.read_data
    original_validate = reshard_load.validate_shard

    def read_data(self: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append(f"read_data {self.path}")
        return original_read(self, *args, **kwargs)

    def validate(directory: Path, **kwargs: Any) -> Any:
        reads.append(f"validate {directory}")
        return original_validate(directory, **kwargs)

    monkeypatch.setattr(FileSystemReader, "read_data", read_data)
    monkeypatch.setattr(reshard_load, "validate_shard", validate)
    return reads


def _set_world(world: int) -> Callable[[Any], None]:
    def edit(manifest: Any) -> None:
        manifest.world_size = world

    return edit


@pytest.mark.parametrize(
    "case, new_world, message",
    [
        ("missing", 2, "shards of ranks [2] are missing"),
        ("mixed", 2, "different world sizes"),
        ("mesh2d", 3, "inner mesh dims (2,) (2 ranks) cannot be kept"),
        ("submesh", 2, "only meshes spanning the whole job"),
        ("pipeline", 2, "per-rank state (pipeline stages"),
        ("padded", 2, "a sharding this version does not understand"),
        ("partial", 2, "has placement 'P'"),
        ("delta", 2, "not a DCP shard (a delta-encoded step?)"),
    ],
)
def test_impossible_reshard_fails_in_the_plan_before_any_read(
    tmp_path: Path, nothing_read: list[str], case: str, new_world: int, message: str
) -> None:
    full = named_tensor("w", (7, 4))
    tensors: dict[str, tuple[torch.Tensor, tuple[str, ...]]] = {"w": (full, ("S0",))}
    mesh: tuple[int, ...] | None = None
    edit: Callable[[int, dict[str, Any], dict[str, torch.Tensor]], None] | None = None
    if case == "mesh2d":
        tensors, mesh = {"w": (full, ("R", "S0"))}, (2, 2)
    elif case == "submesh":

        def edit(rank: int, skeleton: dict[str, Any], flat: dict[str, torch.Tensor]) -> None:
            # tensor parallel over 2 of the 4 ranks: ranks (0, 1) and (2, 3) hold the same two halves
            skeleton["d"]["w"] = _layout("w", (7, 4), ("S0",), (2,), (rank % 2,))
            offsets, sizes = local_slice((7, 4), (2,), (rank % 2,), ("S0",))
            flat["w"] = full[offsets[0] : offsets[0] + sizes[0]].clone()

    elif case == "pipeline":

        def edit(rank: int, skeleton: dict[str, Any], flat: dict[str, torch.Tensor]) -> None:
            if rank == 1:
                flat["stage1.weight"] = torch.ones(2)
                skeleton["d"]["stage1"] = {"T": "stage1.weight"}

    elif case == "padded":

        def edit(rank: int, skeleton: dict[str, Any], flat: dict[str, torch.Tensor]) -> None:
            flat["w"] = torch.zeros(2, 4)  # every piece padded to ceil(7 / 4) rows

    elif case == "partial":

        def edit(rank: int, skeleton: dict[str, Any], flat: dict[str, torch.Tensor]) -> None:
            skeleton["d"]["w"]["DT"]["placements"] = ["P"]

    step_dir = _write_sharded(tmp_path, 4, tensors, mesh=mesh, edit=edit)
    if case == "missing":
        os.rename(step_dir / "rank_00002", step_dir / ".rank_00002.del-x")
    elif case == "mixed":
        rewrite_manifest(step_dir / "rank_00001", _set_world(2))
    elif case == "delta":
        rewrite_manifest(step_dir / "rank_00002", lambda manifest: manifest.meta.update(delta_of=STEP - 1))
    with pytest.raises(ReshardError) as err:
        restore_resharded(tmp_path, STEP, TierIdentity(0, new_world))
    assert message in str(err.value), str(err.value)
    assert str(step_dir) in str(err.value)
    with pytest.raises(ReshardError):  # the plan alone refuses it: the refusal comes before any load
        plan_reshard(step_dir, new_world)
    assert nothing_read == []


def test_uneven_required_message(tmp_path: Path, nothing_read: list[str]) -> None:
    step_dir = _write_sharded(tmp_path, 4, {"w": (named_tensor("w", (7, 4)), ("S0",))})
    with pytest.raises(ReshardError, match=r"'w' dim 0 has 7 elements, which the new mesh \(2,\) cannot split"):
        plan_reshard(step_dir, 2, require_even=True)
    plan_reshard(step_dir, 1, require_even=True)  # 7 rows on one rank is even
    assert nothing_read == []


def test_corrupt_source_shard_is_caught_by_checksum_before_loading(tmp_path: Path, nothing_read: list[str]) -> None:
    """A flipped byte in rank 3's data: the new rank that reads it refuses before DCP loads anything; a new rank
    that does not read it still checks it when it is its share of the verification (3 % 2 == 1)."""
    full = named_tensor("w", (8, 2))
    step_dir = _write_sharded(tmp_path, 4, {"w": (full, ("S0",))})
    flip_byte(data_file(step_dir / "rank_00003"))
    plan = plan_reshard(step_dir, 2)  # manifests and skeletons are intact: the plan passes
    assert plan.ranks_read_by(1) == {1, 2, 3} and plan.ranks_read_by(0) == {0, 1}
    with pytest.raises(CheckpointCorruptError, match=r"rank_00003: checksum mismatch"):
        restore_resharded(tmp_path, STEP, TierIdentity(1, 2), plan=plan)
    assert not any(r.startswith("read_data") for r in nothing_read), nothing_read
    restore_resharded(tmp_path, STEP, TierIdentity(0, 2), plan=plan)  # reads and checks ranks 0-2 only

    # replicated (DDP) state: new rank 1 of 2 reads only source rank 1, but checks rank 3 as its share
    ddp_root = tmp_path / "ddp"
    ddp_dir = _write_sharded(ddp_root, 4, {})
    flip_byte(data_file(ddp_dir / "rank_00003"))
    with pytest.raises(CheckpointCorruptError, match=r"rank_00003: checksum mismatch"):
        restore_resharded(ddp_root, STEP, TierIdentity(1, 2))
    assert restore_resharded(ddp_root, STEP, TierIdentity(0, 2)).source_rank == 0


def test_tampered_skeleton_is_refused_by_the_plan(tmp_path: Path, nothing_read: list[str]) -> None:
    step_dir = _write_sharded(tmp_path, 2, {"w": (named_tensor("w", (4, 2)), ("S0",))})
    skeleton = step_dir / "rank_00001" / "skeleton.json"
    skeleton.write_bytes(skeleton.read_bytes().replace(b'"S0"', b'"S1"'))
    with pytest.raises(ReshardError, match=r"skeleton\.json does not match its manifest"):
        plan_reshard(step_dir, 4)
    assert nothing_read == []


def test_reshardable_steps_lists_other_world_sizes_only(tmp_path: Path) -> None:
    _write_sharded(tmp_path, 2, {})
    assert reshardable_steps(tmp_path, 4) == [STEP]
    assert reshardable_steps(tmp_path, 2) == []
    assert reshardable_steps(tmp_path / "absent", 2) == []
    with pytest.raises(ReshardError, match="no such step directory"):
        plan_reshard(tmp_path / step_dirname(STEP + 1), 2)


def test_same_world_size_plan_is_an_identity(tmp_path: Path) -> None:
    full = named_tensor("w", (5, 3))
    _write_sharded(tmp_path, 2, {"w": (full, ("S0",))})
    parts = [restore_resharded(tmp_path, STEP, TierIdentity(r, 2)).state for r in range(2)]
    assert [p["rank"] for p in parts] == [0, 1]
    assert torch.equal(torch.cat([p["w"] for p in parts]), full)
