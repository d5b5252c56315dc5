"""Budgeted cadences on two real gloo ranks whose snapshots cost differently: every rank chooses the same cadences
(from the costliest rank's figures), so RAM steps and persist agreements stay in step across ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilience.checkpoint.cadence import BUDGET
from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from tests._ranks import run_ranks

pytestmark = pytest.mark.timeout(120)

STEP_S = 0.1


def _scenario(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    now = [0.0]
    manager = CheckpointManager(
        [MemoryTier(every_n_steps=BUDGET, keep=2), LocalTier(tmp / f"rank{rank}", every_n_steps=BUDGET, keep=2)],
        CheckpointConfig(cadence_review_steps=10, collective_timeout_s=60.0),
        clock=lambda: now[0],
    )
    manager.setup()
    state = {"w": torch.full((64,), float(rank))}
    cost = 0.004 * (1 + 2 * rank)  # rank 1's snapshot costs 3x rank 0's: 12% of the step against 4%

    def capture() -> dict[str, Any]:
        now[0] += cost
        return state

    try:
        for step in range(1, 61):
            now[0] += STEP_S
            manager.on_step(step, capture)
            assert manager.wait()  # persists land before the next step: the same deferrals on both ranks
        report = manager.cadence.report()
        return {
            "changes": [[c["step"], c["tier"], c["every_n_steps"]] for c in report["changes"]],
            "snapshot_s": report["measured"]["snapshot_s"],
            "memory_steps": manager.memory_steps(),
            "local_steps": manager.steps()["local"],
        }
    finally:
        manager.close()


def test_every_rank_chooses_the_same_cadences_from_the_costliest_figures(tmp_path: Path) -> None:
    ranks = run_ranks(_scenario, 2, tmp_path)
    assert ranks[0]["changes"] == ranks[1]["changes"] and ranks[0]["changes"]
    assert ranks[0]["snapshot_s"] == ranks[1]["snapshot_s"] == pytest.approx(0.012, rel=1e-3)
    memory = [every for _, tier, every in ranks[0]["changes"] if tier == "memory"]
    assert memory[-1] == 7  # 12% of the step, 1.95% of the budget left by the disk: every 7 steps (6 would be 2%)
    assert ranks[0]["memory_steps"] == ranks[1]["memory_steps"]
    assert ranks[0]["local_steps"] == ranks[1]["local_steps"] and ranks[0]["local_steps"]
