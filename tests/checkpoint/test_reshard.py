"""Resharding: a checkpoint written by N ranks restores on M ranks.

These tests spawn four gloo processes that write real checkpoints through the engine (the manager on 4 ranks, a
LocalTier on the first 2) and restore them on the other world size; each rank writes its findings to a JSON file and
the parent asserts on them. ``test_reshard_plan.py`` pins the layout math, the pre-flight refusals and checksum
detection in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from lightning_resilience.checkpoint import reshard
from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.local import LocalTier, step_dirname
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.reshard import (
    ReshardError,
    load_into,
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
from tests.checkpoint.conftest import data_file, flip_byte, named_tensor

pytestmark = pytest.mark.timeout(120)

WORLD = 4
STEP = 8
PG_TIMEOUT = timedelta(seconds=60)
DRAIN = timedelta(seconds=30)
SPAWN_DEADLINE_S = 100.0


# ----------------------------------------------------------------------------------------------- shared builders
def _ddp_state(rank: int) -> dict[str, Any]:
    """DDP-style: model and optimizer replicated on every rank, an RNG stream and a position per rank."""
    return {
        "model": {"w": named_tensor("w", (5, 3)), "b": named_tensor("b", (3,))},
        "optimizer": {"state": {0: {"exp_avg": named_tensor("m", (5, 3)), "step": torch.tensor(8.0)}}},
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
        model[name] = distribute_tensor(named_tensor(name, shape), mesh, [placement_from_text(p) for p in placements])
    exp_avg = distribute_tensor(named_tensor("m", (10, 3)), one, [Shard(0)])
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
            "full_equal": torch.equal(dt.full_tensor(), named_tensor(name, shape)),
            "local_shape": list(dt.to_local().shape),
            "expected_local_shape": list(expected),
        }
    exp_avg = state["optimizer"]["state"]["w"]["exp_avg"]
    out["exp_avg"] = torch.equal(exp_avg.full_tensor(), named_tensor("m", (10, 3)))
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
        out["load_into"] = {n: torch.equal(t.full_tensor(), named_tensor(n, _SHARDED[n][0])) for n, t in target.items()}
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
