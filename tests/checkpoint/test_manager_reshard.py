"""CheckpointManager.restore on another world size: a 4-rank DDP-style checkpoint resumes on 2 ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.manager import CheckpointManager
from tests._ranks import run_ranks


def _state(rank: int, step: int) -> dict[str, Any]:
    torch.manual_seed(step)  # replicated model and optimizer: the same on every rank, as under DDP
    return {
        "model": {"w": torch.randn(6, 5), "b": torch.randn(5)},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(6, 5)}}},
        "rank_rng": torch.full((2,), float(rank * 100 + step)),
    }


def _write(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    manager = CheckpointManager([LocalTier(tmp / "ckpt", every_n_steps=2, keep=2)])
    manager.setup()
    for step in (2, 4):
        manager.on_step(step, lambda step=step: _state(rank, step))
        assert manager.wait()
    manager.close()
    return {}


def _read(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    manager = CheckpointManager([LocalTier(tmp / "ckpt", every_n_steps=2, keep=2)], CheckpointConfig())
    manager.setup()
    restored = manager.restore()
    manager.close()
    assert restored is not None
    expected = _state(rank, restored.step)
    return {
        "step": restored.step,
        "tier": restored.tier,
        "model_ok": all(torch.equal(restored.state["model"][k], expected["model"][k]) for k in ("w", "b")),
        "optim_ok": torch.equal(
            restored.state["optimizer"]["state"][0]["exp_avg"], expected["optimizer"]["state"][0]["exp_avg"]
        ),
        "rank_rng": restored.state["rank_rng"].tolist(),
    }


def _no_reshard(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    manager = CheckpointManager([LocalTier(tmp / "ckpt")], CheckpointConfig(allow_reshard=False))
    manager.setup()
    restored = manager.restore()
    manager.close()
    return {"restored": restored is not None}


def test_four_ranks_resume_on_two(tmp_path: Path) -> None:
    run_ranks(_write, 4, tmp_path)
    (tmp_path / "pg_store").unlink(missing_ok=True)
    for rank, res in enumerate(run_ranks(_read, 2, tmp_path)):
        assert (res["step"], res["tier"], res["model_ok"], res["optim_ok"]) == (4, "local", True, True), res
        assert res["rank_rng"] == [rank * 100 + 4.0] * 2  # per-rank state from old rank new_rank % 4
    (tmp_path / "pg_store").unlink(missing_ok=True)
    assert run_ranks(_no_reshard, 2, tmp_path) == [{"restored": False}] * 2
