"""No blocking cross-rank wait on the training thread on an ordinary step, with the default and the full preset on 2
and 4 DDP ranks (the ``pretrain_gpt`` recipe under torchrun): the step's one agreement is issued at the step's start
and taken at its end, on a thread of its own; the straggler exchange rides the same thread at its cadence.

Every side-group operation of the suite goes through the fault hook, which records its thread and step. An ordinary
step is one without a check due at its cadence (an SDC replay or reconciliation, which agree on the training
thread by design) and not the first (restore, the first persist views) or the last (the final persist)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40


def _run(preset: str, world: int, out: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
        str(free_port()), "-m", "tests.perf._blocking_waits_script", preset, str(out), str(STEPS),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"waits_rank{r}.json").read_text()) for r in range(world)]


def _due(sdc: dict[str, Any]) -> set[int]:
    cadences = [int(sdc.get(k) or 0) for k in ("replay_every_n_steps", "reconcile_every_n_steps")]
    return {s for s in range(STEPS) for every in cadences if every and (s + 1) % every == 0}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("preset", ["default", "full"])
def test_no_blocking_wait_on_an_ordinary_step(tmp_path: Path, preset: str, world: int) -> None:
    ranks = _run(preset, world, tmp_path)
    for rank, res in enumerate(ranks):
        assert res["global_step"] == STEPS, rank
        ordinary = set(range(1, STEPS - 1)) - _due(res["sdc"])
        assert len(ordinary) >= STEPS // 2, sorted(ordinary)
        blocking = [(s, op) for s, op, on_training_thread in res["ops"] if on_training_thread and s in ordinary]
        assert blocking == [], (rank, blocking)
        # one agreement a step, on the agreement thread (each of its exchanges went through the hook off it)
        assert res["rounds"] == STEPS + 1, rank  # one per step, and one to settle at the end of training
        elsewhere = [op for s, op, on_training_thread in res["ops"] if not on_training_thread and s in ordinary]
        assert "step.agree" in elsewhere, rank
        assert res["fields"][0] == "policy.decision" and "ft.preemption" in res["fields"]
