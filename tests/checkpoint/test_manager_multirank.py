"""CheckpointManager on two real gloo ranks: collective restore, collective corruption fallback, retention safety.

Each test spawns two processes that each run a manager, write their per-rank results to a JSON file and exit; the
parent asserts on both files. Every collective and every wait has a bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.local import LocalTier, step_dirname
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.testing.faults import FaultPlan
from tests._ranks import run_ranks

pytestmark = pytest.mark.timeout(90)

WORLD = 2
STEPS = range(1, 7)
PG_TIMEOUT = timedelta(seconds=60)
DRAIN = timedelta(seconds=30)
SPAWN_DEADLINE_S = 60.0


# ----------------------------------------------------------------------------------------------- in the children
def _state(rank: int, step: int) -> dict[str, Any]:
    """A small training-like state whose every value depends on rank and step."""
    base = float(rank * 1000 + step)
    return {
        "step": step,
        "rank": rank,
        "model": {"w": torch.full((3, 4), base), "b": torch.arange(4, dtype=torch.int64) + step},
        "optimizer": {"state": {0: {"exp_avg": torch.full((3, 4), -base)}}, "param_groups": [{"betas": (0.9, 0.99)}]},
        "best": math.inf,
    }


def _state_equal(actual: Any, expected: Any) -> bool:
    if type(actual) is not type(expected):
        return False
    if isinstance(expected, torch.Tensor):
        return actual.dtype == expected.dtype and torch.equal(actual, expected)
    if isinstance(expected, dict):
        return list(actual) == list(expected) and all(_state_equal(actual[k], v) for k, v in expected.items())
    if isinstance(expected, list | tuple):
        return len(actual) == len(expected) and all(_state_equal(a, e) for a, e in zip(actual, expected))
    return bool(actual == expected)


def _tiers(root: Path) -> tuple[MemoryTier, LocalTier]:
    return MemoryTier(every_n_steps=1, keep=2), LocalTier(root, every_n_steps=2, keep=2)


def _manager(root: Path) -> tuple[CheckpointManager, MemoryTier, LocalTier]:
    memory, local = _tiers(root)
    mgr = CheckpointManager([memory, local], CheckpointConfig(drain_timeout_s=DRAIN.total_seconds()))
    mgr.setup()
    return mgr, memory, local


def _train(rank: int, mgr: CheckpointManager) -> None:
    for step in STEPS:
        mgr.on_step(step, lambda step=step: _state(rank, step), meta={"step": step})
        # waiting here makes the persisted steps deterministic (2, 4, 6): no step is deferred by a busy worker
        assert mgr.wait(DRAIN), f"rank {rank}: persist of step {step} did not finish within {DRAIN}"


def _fresh_restore(rank: int, root: Path) -> dict[str, Any]:
    """A new process's view: new tiers over the same directory, collective restore."""
    mgr, _, local = _manager(root)
    try:
        restored = mgr.restore()
        out: dict[str, Any] = {
            "disk_steps": local.list_steps(),
            "step": None if restored is None else restored.step,
            "tier": None if restored is None else restored.tier,
            "meta": None if restored is None else restored.meta,
            "skipped_corrupt": list(mgr.stats.skipped_corrupt),
        }
        out["state_ok"] = restored is not None and _state_equal(restored.state, _state(rank, restored.step))
        return out
    finally:
        mgr.close(DRAIN)


def _scenario_agree(rank: int, tmp: Path) -> dict[str, Any]:
    root = tmp / "ckpt"
    mgr, memory, local = _manager(root)
    _train(rank, mgr)
    memory_steps = memory.list_steps()
    same = mgr.restore()
    result: dict[str, Any] = {
        "memory_steps": memory_steps,
        "memory_after_restore": memory.list_steps(),  # a RAM restore hands the step's buffers over
        "local_steps": local.list_steps(),
        "local_writes": mgr.stats.tiers["local"].writes,
        "local_failures": mgr.stats.tiers["local"].failures,
        "same_step": None if same is None else same.step,
        "same_tier": None if same is None else same.tier,
        "same_state_ok": same is not None and _state_equal(same.state, _state(rank, same.step)),
    }
    mgr.close(DRAIN)
    dist.barrier()
    result["fresh"] = _fresh_restore(rank, root)
    return result


def _scenario_corrupt(rank: int, tmp: Path) -> dict[str, Any]:
    root = tmp / "ckpt"
    mgr, _, local = _manager(root)
    _train(rank, mgr)
    steps = local.list_steps()
    mgr.close(DRAIN)
    dist.barrier()
    if rank == 1:  # bit rot in rank 1's newest shard only; its size is unchanged
        (data,) = sorted((root / step_dirname(6) / "rank_00001").glob("*.distcp"))
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    dist.barrier()
    return {"local_steps": steps, "fresh": _fresh_restore(rank, root)}


def _rank_1_cannot_write_from(first: int) -> FaultPlan:
    plan = FaultPlan()
    for step in range(first, 13):
        plan.fail_at(1, step, "tier.local.write")
    return plan


def _scenario_retention(rank: int, tmp: Path) -> dict[str, Any]:
    root = tmp / "ckpt"
    mgr, _, local = _manager(root)
    _rank_1_cannot_write_from(4).instrument(local)
    _train(rank, mgr)
    result: dict[str, Any] = {
        "local_steps": local.list_steps(),
        "local_writes": mgr.stats.tiers["local"].writes,
        "local_failures": mgr.stats.tiers["local"].failures,
        "last_error": mgr.stats.tiers["local"].last_error,
    }
    mgr.close(DRAIN)
    dist.barrier()
    result["fresh"] = _fresh_restore(rank, root)
    return result


def _scenario_async_retention(rank: int, tmp: Path) -> dict[str, Any]:
    """Like the retention scenario, but without waiting between steps: persists overlap training and get deferred."""
    root = tmp / "ckpt"
    mgr, _, local = _manager(root)
    _rank_1_cannot_write_from(4).instrument(local)
    for step in range(1, 13):
        mgr.on_step(step, lambda step=step: _state(rank, step))
        if step % 3 == 0:  # a slow step now and then: later persists start, others overlap or are deferred
            assert mgr.wait(DRAIN)
    mgr.close(DRAIN)
    stats = mgr.stats.tiers["local"]
    result: dict[str, Any] = {
        "local_steps": local.list_steps(),
        "attempts": stats.writes + stats.failures,
        "failures": stats.failures,
    }
    dist.barrier()
    result["fresh"] = _fresh_restore(rank, root)
    return result


def _scenario_read_error(rank: int, tmp: Path) -> dict[str, Any]:
    """Rank 1 hits an I/O error (EIO) reading its newest shard during restore."""
    root = tmp / "ckpt"
    mgr, _, _ = _manager(root)
    _train(rank, mgr)
    mgr.close(DRAIN)
    dist.barrier()
    fresh, _, local = _manager(root)
    FaultPlan().fail_at(1, 6, "tier.local.read").instrument(local)  # an I/O error (EIO-like) on rank 1 only
    try:
        restored = fresh.restore()
        return {"step": None if restored is None else restored.step, "skipped": list(fresh.stats.skipped_corrupt)}
    finally:
        fresh.close(DRAIN)


_SCENARIOS: dict[str, Callable[[int, Path], dict[str, Any]]] = {
    "agree": _scenario_agree,
    "corrupt": _scenario_corrupt,
    "retention": _scenario_retention,
    "async_retention": _scenario_async_retention,
    "read_error": _scenario_read_error,
}


def _named(rank: int, world: int, tmp: Path, scenario: str) -> dict[str, Any]:
    return _SCENARIOS[scenario](rank, tmp)


def _spawn(scenario: str, tmp: Path) -> list[dict[str, Any]]:
    """Run ``scenario`` on every rank and return each rank's result; fails (never hangs) past the deadline."""
    return run_ranks(_named, WORLD, tmp, scenario, deadline_s=SPAWN_DEADLINE_S, pg_timeout=PG_TIMEOUT)


def test_both_ranks_restore_the_same_newest_step(tmp_path: Path) -> None:
    """All-good run: disk keeps the newest 2 persisted steps; in-process and fresh restores agree on step 6."""
    results = _spawn("agree", tmp_path)
    for rank, res in enumerate(results):
        assert res["local_failures"] == 0, res
        assert res["local_writes"] == 3, res  # steps 2, 4, 6
        assert res["local_steps"] == [4, 6], res  # keep=2, step 2 pruned once 4 was common to both ranks
        assert res["memory_steps"] == [5, 6] and res["memory_after_restore"] == [5], res
        assert (res["same_step"], res["same_tier"], res["same_state_ok"]) == (6, "memory", True), res
        fresh = res["fresh"]
        assert (fresh["step"], fresh["tier"], fresh["state_ok"]) == (6, "local", True), (rank, fresh)
        assert fresh["meta"] == {"step": 6}
        assert fresh["skipped_corrupt"] == []
    for step in (2, 4, 6):
        present = [(tmp_path / "ckpt" / step_dirname(step) / f"rank_{r:05d}").is_dir() for r in range(WORLD)]
        assert present == [step != 2] * WORLD, (step, present)


def test_corrupt_shard_on_one_rank_makes_both_fall_back(tmp_path: Path) -> None:
    """Rank 1's step-6 shard is corrupt: both ranks restore step 4; only rank 1 reports a skipped shard."""
    results = _spawn("corrupt", tmp_path)
    assert [r["local_steps"] for r in results] == [[4, 6], [4, 6]]
    fresh0, fresh1 = results[0]["fresh"], results[1]["fresh"]
    assert (fresh0["step"], fresh1["step"]) == (4, 4)
    assert fresh0["state_ok"] and fresh1["state_ok"]
    assert fresh0["tier"] == fresh1["tier"] == "local"
    assert fresh0["skipped_corrupt"] == []
    assert len(fresh1["skipped_corrupt"]) == 1
    assert "step 6" in fresh1["skipped_corrupt"][0] and "checksum" in fresh1["skipped_corrupt"][0]


def test_retention_keeps_the_newest_step_committed_on_every_rank(tmp_path: Path) -> None:
    """Rank 1 cannot write steps >= 4: rank 0 must keep step 2 on disk, and a fresh restore agrees on step 2."""
    results = _spawn("retention", tmp_path)
    r0, r1 = results
    assert r1["local_failures"] == 2 and "InjectedFault" in (r1["last_error"] or ""), r1
    assert r1["local_steps"] == [2], r1
    assert r0["local_failures"] == 0, r0
    assert 2 in r0["local_steps"], f"rank 0 pruned step 2, the only step every rank committed: {r0}"
    assert r0["local_steps"] == [2, 4, 6], r0
    for res in results:
        fresh = res["fresh"]
        assert (fresh["step"], fresh["tier"], fresh["state_ok"]) == (2, "local", True), fresh


def test_async_persists_keep_a_common_step_and_restore_agrees(tmp_path: Path) -> None:
    """Without waits (persists overlap steps, some are deferred) both ranks attempt the same persists, rank 0
    keeps rank 1's only committed step, and a fresh restore agrees on it."""
    r0, r1 = _spawn("async_retention", tmp_path)
    assert r0["attempts"] == r1["attempts"] >= 2, (r0, r1)  # deferral is collective: same steps on both ranks
    assert r0["failures"] == 0 and r1["failures"] == r1["attempts"] - 1, (r0, r1)
    assert r1["local_steps"] == [2], r1
    assert 2 in r0["local_steps"], f"rank 0 pruned step 2, the only step every rank committed: {r0}"
    for res in (r0, r1):
        assert (res["fresh"]["step"], res["fresh"]["state_ok"]) == (2, True), res["fresh"]


def test_io_error_reading_one_shard_falls_back_collectively(tmp_path: Path) -> None:
    """An OSError (EIO) while rank 1 reads its step-6 shard makes both ranks restore step 4, like corruption does
    (rank 1 still reaches the agreement: the other rank is never left waiting)."""
    r0, r1 = _spawn("read_error", tmp_path)
    assert (r0["step"], r1["step"]) == (4, 4), (r0, r1)
    assert r0["skipped"] == [] and len(r1["skipped"]) == 1, (r0, r1)
