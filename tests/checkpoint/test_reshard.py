"""Resharding: a checkpoint written by N ranks restores on M ranks.

Multi-rank tests spawn four gloo processes that write real checkpoints through the engine (the manager on 4 ranks,
a LocalTier on the first 2) and restore them on the other world size; each rank writes its findings to a JSON file
and the parent asserts on them. Single-process tests write hand-laid shards through ``LocalTier`` to pin the layout
math, the pre-flight refusals (nothing read) and checksum detection.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from lightning_resilience.checkpoint import reshard
from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.local import LocalTier, step_dirname
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.reshard import (
    ReshardError,
    load_into,
    local_slice,
    plan_reshard,
    reshardable_steps,
    restore_resharded,
)
from lightning_resilience.checkpoint.reshard import agree as reshard_agree
from lightning_resilience.checkpoint.reshard import load as reshard_load
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tier import TierIdentity
from lightning_resilience.checkpoint.tree import flatten_state, placement_from_text
from tests._ranks import run_ranks
from tests.checkpoint.conftest import data_file, flip_byte, rewrite_manifest

pytestmark = pytest.mark.timeout(120)

WORLD = 4
STEP = 8
PG_TIMEOUT = timedelta(seconds=60)
DRAIN = timedelta(seconds=30)
SPAWN_DEADLINE_S = 100.0


# ----------------------------------------------------------------------------------------------- shared builders
def _full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A deterministic global tensor, the same on every rank."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=gen)


def _ddp_state(rank: int) -> dict[str, Any]:
    """DDP-style: model and optimizer replicated on every rank, an RNG stream and a position per rank."""
    return {
        "model": {"w": _full("w", (5, 3)), "b": _full("b", (3,))},
        "optimizer": {"state": {0: {"exp_avg": _full("m", (5, 3)), "step": torch.tensor(8.0)}}},
        "rng": torch.full((4,), rank, dtype=torch.uint8),
        "position": {"rank": rank, "batches": 10 + rank},
    }


# sharded tensors: name -> (global shape, placements, mesh kind); "1d" is (world,), "2d" is (world // 2, 2)
_SHARDED: dict[str, tuple[tuple[int, ...], tuple[str, ...], str]] = {
    "w": ((10, 3), ("S0",), "1d"),  # 10 rows over 4 ranks: 3, 3, 3, 1; over 2: 5, 5
    "v": ((7,), ("S0",), "1d"),  # over 4: 2, 2, 2, 1
    "col": ((3, 6), ("S1",), "1d"),
    "tiny": ((3, 2), ("S0",), "1d"),  # over 4: 1, 1, 1, 0 (an empty piece)
    "rep": ((4,), ("R",), "1d"),
    "hsdp": ((6, 4), ("R", "S0"), "2d"),  # replicate over the outer dim, shard over the inner one
}


# ----------------------------------------------------------------------------------------------- in the children
def _meshes(world: int) -> tuple[DeviceMesh, DeviceMesh]:
    """1-D and 2-D meshes over ranks [0, world); every rank of the default group must call (new_group)."""
    one = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("dp",))
    two = DeviceMesh("cpu", torch.arange(world).reshape(world // 2, 2), mesh_dim_names=("rep", "shard"))
    return one, two


def _fsdp_state(one: DeviceMesh, two: DeviceMesh) -> dict[str, Any]:
    model = {}
    for name, (shape, placements, kind) in _SHARDED.items():
        mesh = one if kind == "1d" else two
        model[name] = distribute_tensor(_full(name, shape), mesh, [placement_from_text(p) for p in placements])
    exp_avg = distribute_tensor(_full("m", (10, 3)), one, [Shard(0)])
    return {
        "model": model,
        "optimizer": {"state": {"w": {"exp_avg": exp_avg, "step": torch.tensor(8.0)}}, "lr": 0.1},
        "epoch": 2,
    }


def _rebuilder(one: DeviceMesh, two: DeviceMesh) -> Callable[[torch.Tensor, Mapping[str, Any]], DTensor]:
    def rebuild(local: torch.Tensor, layout: Mapping[str, Any]) -> DTensor:
        mesh = one if len(layout["placements"]) == 1 else two
        assert list(mesh.shape) == layout["mesh_shape"]
        assert list(mesh.get_coordinate() or ()) == layout["coord"]
        return DTensor.from_local(
            local,
            device_mesh=mesh,
            placements=[placement_from_text(p) for p in layout["placements"]],
            run_check=False,
            shape=torch.Size(layout["shape"]),
            stride=tuple(layout["stride"]),
        )

    return rebuild


def _write(root: Path, state: Any, rank: int, world: int) -> None:
    """One rank's shard through the engine's tier (what the manager's persist does)."""
    tier = LocalTier(root, every_n_steps=1, keep=2)
    tier.bind(TierIdentity(rank, world))
    flat = flatten_state(state)
    tier.write(StagedSnapshot(STEP, flat.skeleton, {n: t.clone() for n, t in flat.tensors.items()}, {"w": world}))


def _write_with_manager(root: Path, state: Any) -> None:
    """All four ranks persist through the full engine (setup, flush, close)."""
    mgr = CheckpointManager([LocalTier(root, every_n_steps=100, keep=2)], CheckpointConfig())
    mgr.setup()
    try:
        mgr.flush(STEP, lambda: state, meta={"w": WORLD})
    finally:
        mgr.close(DRAIN)


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(_same(a[k], v) for k, v in b.items())
    return bool(a == b)


def _scenario_ddp(rank: int, tmp: Path) -> dict[str, Any]:
    root4, root2 = tmp / "four", tmp / "two"
    _write_with_manager(root4, _ddp_state(rank))
    if rank < 2:
        _write(root2, _ddp_state(rank), rank, 2)
    dist.barrier()
    out: dict[str, Any] = {}
    if rank < 2:  # 4 -> 2
        res = restore_resharded(root4, STEP, TierIdentity(rank, 2))
        want = _ddp_state(rank)  # source rank = rank % 4 = rank
        out["4to2"] = {
            "model": _same(res.state["model"], want["model"]),
            "optimizer": _same(res.state["optimizer"], want["optimizer"]),
            "rng": res.state["rng"].tolist(),
            "position": res.state["position"],
            "source": res.source_rank,
            "old": res.old_world_size,
            "meta": res.meta,
        }
    res = restore_resharded(root2, STEP, TierIdentity(rank, WORLD))  # 2 -> 4
    want = _ddp_state(rank % 2)
    out["2to4"] = {
        "model": _same(res.state["model"], want["model"]),
        "optimizer": _same(res.state["optimizer"], want["optimizer"]),
        "rng": res.state["rng"].tolist(),
        "source": res.source_rank,
    }
    out["reshardable"] = [reshardable_steps(root4, 2), reshardable_steps(root4, 4)]
    return out


def _group_ops(group: Any, size: int) -> tuple[Callable[[Any], list[Any]], Callable[[bool], bool]]:
    def all_gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * size
        dist.all_gather_object(out, obj, group=group)
        return out

    def all_true(flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return bool(t.item())

    return all_gather, all_true


def _scenario_agreed(rank: int, tmp: Path) -> dict[str, Any]:
    """Collective resharded restore: step 12 cannot be planned on one rank, step 8 has a corrupt source shard that
    one rank detects; both new ranks must end on step 4, and nobody may load step 12."""
    root4, root2 = tmp / "four", tmp / "two"
    mgr = CheckpointManager([LocalTier(root4, every_n_steps=100, keep=3)], CheckpointConfig())
    mgr.setup()
    try:
        for step in (4, 8, 12):
            mgr.flush(step, partial(dict, _ddp_state(rank), step=step))
    finally:
        mgr.close(DRAIN)
    if rank < 2:
        _write(root2, {**_ddp_state(rank), "step": STEP}, rank, 2)
    dist.barrier()
    if rank == 3:
        flip_byte(data_file(root4 / step_dirname(8) / "rank_00003"))
    pair = dist.new_group([0, 1], backend="gloo")  # every rank of the default group takes part in creating it
    dist.barrier()
    loaded: list[int] = []
    load = reshard.load_resharded

    def spy(plan: reshard.ReshardPlan, new_rank: int, **kwargs: Any) -> StagedSnapshot:
        loaded.append(plan.step)
        return load(plan, new_rank, **kwargs)

    reshard_load.load_resharded = spy  # type: ignore[assignment]
    out: dict[str, Any] = {}
    if rank < 2:
        if rank == 1:  # this rank alone cannot plan step 12 (as if a shard were missing from its view)
            plan = reshard.plan_reshard

            def refuse_12(step_dir: Path, new_world_size: int, **kwargs: Any) -> reshard.ReshardPlan:
                if step_dir.name == step_dirname(12):
                    raise ReshardError(f"{step_dir}: injected refusal")
                return plan(step_dir, new_world_size, **kwargs)

            reshard_agree.plan_reshard = refuse_12  # type: ignore[assignment]
        skipped: list[str] = []
        gather, all_true = _group_ops(pair, 2)
        found = reshard.restore_resharded_agreed(
            {"local": root4}, TierIdentity(rank, 2), all_gather=gather, all_true=all_true, on_skip=skipped.append
        )
        assert found is not None
        tier, res = found
        out["4to2"] = {"tier": tier, "step": res.step, "state_step": res.state["step"], "skipped": skipped}
        out["loaded"] = list(loaded)
    dist.barrier()
    gather, all_true = _group_ops(None, WORLD)
    found = reshard.restore_resharded_agreed(
        {"local": root2}, TierIdentity(rank, WORLD), all_gather=gather, all_true=all_true
    )
    assert found is not None
    out["2to4"] = {"step": found[1].step, "rng": found[1].state["rng"].tolist()}
    return out


def _check_fsdp(state: dict[str, Any], tag: str) -> dict[str, Any]:
    """Gather every sharded tensor (collective on its mesh) and compare it with the original global tensor."""
    out: dict[str, Any] = {}
    for name, (shape, _, _) in _SHARDED.items():
        dt = state["model"][name]
        assert isinstance(dt, DTensor), (tag, name, type(dt))
        expected, _ = _compute_local_shape_and_global_offset(
            dt.shape, dt.device_mesh.shape, list(dt.device_mesh.get_coordinate() or ()), dt.placements
        )
        out[name] = {
            "full_equal": torch.equal(dt.full_tensor(), _full(name, shape)),
            "local_shape": list(dt.to_local().shape),
            "expected_local_shape": list(expected),
        }
    exp_avg = state["optimizer"]["state"]["w"]["exp_avg"]
    out["exp_avg"] = torch.equal(exp_avg.full_tensor(), _full("m", (10, 3)))
    out["step"] = float(state["optimizer"]["state"]["w"]["step"])
    out["lr"], out["epoch"] = state["optimizer"]["lr"], state["epoch"]
    return out


def _scenario_fsdp(rank: int, tmp: Path) -> dict[str, Any]:
    root4, root2 = tmp / "four", tmp / "two"
    one4, two4 = _meshes(WORLD)
    one2, two2 = _meshes(2)  # collective on all four ranks; only ranks 0 and 1 are in it
    state4 = _fsdp_state(one4, two4)
    out: dict[str, Any] = {
        "recorded": {"mesh_shape": list(one4.shape), "coord": list(one4.get_coordinate() or ())},
        "layout": flatten_state(state4).skeleton["d"]["model"]["d"]["w"]["DT"],
    }
    _write_with_manager(root4, state4)
    if rank < 2:
        _write(root2, _fsdp_state(one2, two2), rank, 2)
    dist.barrier()
    if rank < 2:  # 4 -> 2: DTensors rebuilt on the 2-rank meshes, gathered there
        res = restore_resharded(root4, STEP, TierIdentity(rank, 2), rebuild_dtensor=_rebuilder(one2, two2))
        out["4to2"] = _check_fsdp(res.state, "4to2")
        # the collective path: DCP's stock planner into DTensors allocated on the new mesh
        plan = plan_reshard(root4 / step_dirname(STEP), 2)
        target = {
            name: distribute_tensor(
                torch.zeros(shape), one2 if kind == "1d" else two2, [placement_from_text(p) for p in placements]
            )
            for name, (shape, placements, kind) in _SHARDED.items()
        }
        load_into(plan, {f"model/{n}": t for n, t in target.items()}, process_group=one2.get_group())
        out["load_into"] = {n: torch.equal(t.full_tensor(), _full(n, _SHARDED[n][0])) for n, t in target.items()}
    dist.barrier()
    res = restore_resharded(root2, STEP, TierIdentity(rank, WORLD), rebuild_dtensor=_rebuilder(one4, two4))
    out["2to4"] = _check_fsdp(res.state, "2to4")
    return out


def _fsdp_module(mesh: DeviceMesh, seed: int) -> torch.nn.Module:
    """A tiny FSDP2 model; its weights (3, 5) and (2, 3) split unevenly over 4 and 2 ranks."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_train_step(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(4, 5)).sum().backward()
    optimizer.step()
    return optimizer


def _gathered(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Full tensors of the model and of Adam's moments (collective on the model's mesh)."""
    out = {f"model/{k}": v.full_tensor() for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        out[f"exp_avg/{index}"] = state["exp_avg"].full_tensor()
        out[f"exp_avg_sq/{index}"] = state["exp_avg_sq"].full_tensor()
    return out


def _restore_module(root: Path, rank: int, world: int, mesh: DeviceMesh, expected: dict[str, torch.Tensor]) -> bool:
    """Restore into a freshly initialised FSDP2 model and optimizer on ``mesh``; compare the gathered tensors."""
    res = restore_resharded(root, STEP, TierIdentity(rank, world), rebuild_dtensor=_rebuilder(mesh, mesh))
    model = _fsdp_module(mesh, seed=123)  # other initial values: only the checkpoint can make them equal
    model.load_state_dict(res.state["model"])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    optimizer.load_state_dict(res.state["optimizer"])
    got = _gathered(model, optimizer)
    return got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items())


def _scenario_fully_shard(rank: int, tmp: Path) -> dict[str, Any]:
    root4, root2 = tmp / "four", tmp / "two"
    one4, _ = _meshes(WORLD)
    one2, _ = _meshes(2)
    model = _fsdp_module(one4, seed=0)
    optimizer = _fsdp_train_step(model)
    expected4 = _gathered(model, optimizer)
    _write_with_manager(root4, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    expected2: list[Any] = [None]
    if rank < 2:
        model2 = _fsdp_module(one2, seed=7)
        optimizer2 = _fsdp_train_step(model2)
        expected2 = [_gathered(model2, optimizer2)]
        _write(root2, {"model": model2.state_dict(), "optimizer": optimizer2.state_dict()}, rank, 2)
    dist.broadcast_object_list(expected2, src=0)  # ranks 2 and 3 compare against what ranks 0 and 1 wrote
    out: dict[str, Any] = {}
    if rank < 2:
        out["4to2"] = _restore_module(root4, rank, 2, one2, expected4)
    dist.barrier()
    out["2to4"] = _restore_module(root2, rank, WORLD, one4, expected2[0])
    return out


_SCENARIOS: dict[str, Callable[[int, Path], dict[str, Any]]] = {
    "ddp": _scenario_ddp,
    "fsdp": _scenario_fsdp,
    "fully_shard": _scenario_fully_shard,
    "agreed": _scenario_agreed,
}


def _named(rank: int, world: int, tmp: Path, scenario: str) -> dict[str, Any]:
    return _SCENARIOS[scenario](rank, tmp)


def _spawn(scenario: str, tmp: Path) -> list[dict[str, Any]]:
    return run_ranks(_named, WORLD, tmp, scenario, deadline_s=SPAWN_DEADLINE_S, pg_timeout=PG_TIMEOUT)


def test_ddp_replicated_state_reshards_4_to_2_and_2_to_4(tmp_path: Path) -> None:
    """Model and optimizer come back identical; per-rank state is that of source rank ``new_rank % N``."""
    results = _spawn("ddp", tmp_path)
    for rank, res in enumerate(results):
        two_to_four = res["2to4"]
        assert two_to_four["model"] and two_to_four["optimizer"], (rank, two_to_four)
        assert two_to_four["source"] == rank % 2
        assert two_to_four["rng"] == [rank % 2] * 4
        assert res["reshardable"] == [[STEP], []]
        if rank < 2:
            four_to_two = res["4to2"]
            assert four_to_two["model"] and four_to_two["optimizer"], (rank, four_to_two)
            assert (four_to_two["source"], four_to_two["old"]) == (rank, 4)
            assert four_to_two["rng"] == [rank] * 4
            assert four_to_two["position"] == {"rank": rank, "batches": 10 + rank}
            assert four_to_two["meta"] == {"w": 4}
        else:
            assert "4to2" not in res


def test_ranks_agree_on_the_resharded_step_before_loading(tmp_path: Path) -> None:
    """Step 12 is refused by one rank's plan: no rank loads it. Step 8 has a corrupt source shard that only new
    rank 1 checks: both fall back to step 4 together. 2 -> 4 agrees on the only step."""
    results = _spawn("agreed", tmp_path)
    r0, r1 = results[0]["4to2"], results[1]["4to2"]
    assert (r0["step"], r1["step"]) == (4, 4) and (r0["state_step"], r1["state_step"]) == (4, 4), (r0, r1)
    assert r0["tier"] == r1["tier"] == "local"
    assert results[0]["loaded"] == [8, 4] and results[1]["loaded"] == [8, 4]  # 12 was never loaded
    assert r0["skipped"] == []
    assert len(r1["skipped"]) == 2, r1["skipped"]
    assert "step 12" in r1["skipped"][0] and "injected refusal" in r1["skipped"][0]
    assert "step 8" in r1["skipped"][1] and "rank_00003: checksum mismatch" in r1["skipped"][1]
    assert [r["2to4"] for r in results] == [{"step": STEP, "rng": [rank % 2] * 4} for rank in range(WORLD)]


def test_fsdp_dtensor_state_reshards_4_to_2_and_2_to_4(tmp_path: Path) -> None:
    """Sharded (even, uneven, empty-piece, column, replicated and 2-D HSDP) DTensors gather to the originals."""
    results = _spawn("fsdp", tmp_path)
    for rank, res in enumerate(results):
        assert res["recorded"] == {"mesh_shape": [4], "coord": [rank]}
        assert res["layout"]["mesh_shape"] == [4] and res["layout"]["coord"] == [rank]
        checks = [("2to4", res["2to4"])] + ([("4to2", res["4to2"])] if rank < 2 else [])
        for tag, check in checks:
            for name in _SHARDED:
                entry = check[name]
                assert entry["full_equal"], (rank, tag, name)
                assert entry["local_shape"] == entry["expected_local_shape"], (rank, tag, name, entry)
            assert check["exp_avg"] and check["step"] == 8.0, (rank, tag)
            assert (check["lr"], check["epoch"]) == (0.1, 2)
        if rank < 2:
            assert all(res["load_into"].values()), res["load_into"]
    # the uneven and empty pieces really were uneven: 10 rows over 2 ranks is 5/5, "tiny" over 4 is 1/1/1/0
    assert [r["2to4"]["tiny"]["local_shape"][0] for r in results] == [1, 1, 1, 0]
    assert [r["4to2"]["w"]["local_shape"][0] for r in results[:2]] == [5, 5]


def test_fully_shard_model_and_adam_state_reshard_4_to_2_and_2_to_4(tmp_path: Path) -> None:
    """A real FSDP2 model (``fully_shard``) and its Adam state, restored into a fresh model on the other world size,
    gather to exactly the tensors that were written."""
    results = _spawn("fully_shard", tmp_path)
    assert [r["2to4"] for r in results] == [True] * WORLD
    assert [r.get("4to2") for r in results] == [True, True, None, None]


# ------------------------------------------------------------------------------------------------- single process
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
    full = {"w": _full("w", (7, 3)), "c": _full("c", (2, 5)), "r": _full("r", (3,))}
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
    full = _full("w", (6, 2))

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
    full = _full("w", (9, 2))

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
    full = _full("w", (7, 4))
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
    step_dir = _write_sharded(tmp_path, 4, {"w": (_full("w", (7, 4)), ("S0",))})
    with pytest.raises(ReshardError, match=r"'w' dim 0 has 7 elements, which the new mesh \(2,\) cannot split"):
        plan_reshard(step_dir, 2, require_even=True)
    plan_reshard(step_dir, 1, require_even=True)  # 7 rows on one rank is even
    assert nothing_read == []


def test_corrupt_source_shard_is_caught_by_checksum_before_loading(tmp_path: Path, nothing_read: list[str]) -> None:
    """A flipped byte in rank 3's data: the new rank that reads it refuses before DCP loads anything; a new rank
    that does not read it still checks it when it is its share of the verification (3 % 2 == 1)."""
    full = _full("w", (8, 2))
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
    step_dir = _write_sharded(tmp_path, 2, {"w": (_full("w", (4, 2)), ("S0",))})
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
    full = _full("w", (5, 3))
    _write_sharded(tmp_path, 2, {"w": (full, ("S0",))})
    parts = [restore_resharded(tmp_path, STEP, TierIdentity(r, 2)).state for r in range(2)]
    assert [p["rank"] for p in parts] == [0, 1]
    assert torch.equal(torch.cat([p["w"] for p in parts]), full)
