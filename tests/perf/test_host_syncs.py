"""No host read of a device tensor by our code on an ordinary step, with the default and the full preset on 2 DDP
ranks (the ``pretrain_gpt`` recipe under torchrun, a CSV logger attached). See :mod:`tests._host_syncs` for how a
CPU run recognises what would be a host-device synchronisation on a GPU.

Due steps (a replay or a reconciliation at its cadence) must read device values; they are counted and bounded by a
small constant (one read per check, however many tensors it covers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilience._staging import HostStage, to_host
from tests._host_syncs import HostSyncCounter
from tests._ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
STEPS = 50
MAX_READS_PER_ORDINARY_STEP = 0.1
MAX_READS_PER_DUE_STEP = 8


def _run(preset: str, out: Path, *overrides: str) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "tests.perf._host_sync_script",
        preset,
        str(out),
        str(STEPS),
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"syncs_rank{r}.json").read_text()) for r in range(2)]


def _due(sdc: dict[str, Any]) -> set[int]:
    """Steps (0-based, as ``global_step`` at the batch start) that run a replay or a reconciliation."""
    cadences = [int(sdc.get(k) or 0) for k in ("replay_every_n_steps", "reconcile_every_n_steps")]
    return {s for s in range(STEPS) for every in cadences if every and (s + 1) % every == 0}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("preset", ["default", "full"])
def test_no_host_reads_on_ordinary_steps(tmp_path: Path, preset: str) -> None:
    for rank, report in enumerate(_run(preset, tmp_path)):
        assert report["global_step"] == STEPS
        due = _due(report["sdc"])
        reads = {int(s): r for s, r in report["reads"].items() if 0 <= int(s) < STEPS}
        ordinary = [s for s in range(STEPS) if s not in due]
        per_step = sum(len(reads.get(s, [])) for s in ordinary) / len(ordinary)
        where = sorted({r for s in ordinary for r in reads.get(s, [])})
        assert per_step <= MAX_READS_PER_ORDINARY_STEP, f"rank {rank}, {preset}: {per_step:.2f} reads/step: {where}"
        for s in sorted(due):
            assert len(reads.get(s, [])) <= MAX_READS_PER_DUE_STEP, f"rank {rank}, {preset}, step {s}: {reads[s]}"


def test_counter_sees_our_reads_and_not_the_users() -> None:
    """The harness itself: a read by our code of a value derived from the model counts; the same read in user
    code, a read of a host-made tensor and a staged (non-blocking) copy do not."""
    model = torch.nn.Linear(4, 1)
    counter = HostSyncCounter()
    with counter.active():
        counter.begin_step(0, list(model.parameters()))
        loss = model(torch.ones(2, 4)).sum()
        float(loss)  # the user's own read
        assert float(torch.tensor(3.0)) == 3.0  # a host tensor
        stage = HostStage()
        stage.put("loss", [loss.detach()])
        assert [k for k, _ in stage.ready()] == ["loss"]
        counter.begin_step(1, list(model.parameters()))
        to_host([loss.detach().reshape(1), model.weight.sum().reshape(1)])  # ours: one read for both
    assert {s: len(r) for s, r in counter.reads.items()} == {1: 1}
    assert "to_host" in counter.reads[1][0]
    assert counter.counts[0]["staged"] == 1


def test_host_values_are_read_at_once_as_the_staged_copy_would() -> None:
    """On the CPU a reading is taken when it is put (no stack, no copy): the same numbers the staged copy gives,
    converted to its dtype, and ready at once, oldest first."""
    from lightning_resilience import _staging

    values = [torch.tensor(0.1, dtype=torch.float32), torch.tensor(3.5, dtype=torch.bfloat16), torch.tensor(7)]
    counts = [torch.tensor(2**40 + 3, dtype=torch.int64), torch.tensor(-5, dtype=torch.int32)]
    quick, staged = HostStage(), HostStage()
    quick.put("a", values)
    quick.put("b", counts, dtype=torch.int64)
    assert len(quick) == 2
    original = _staging.READ_AT_ONCE
    _staging.READ_AT_ONCE = frozenset()
    try:
        staged.put("a", values)
        staged.put("b", counts, dtype=torch.int64)
    finally:
        _staging.READ_AT_ONCE = original
    got, expected = quick.ready(), staged.ready()
    assert got == expected == [("a", [0.10000000149011612, 3.5, 7.0]), ("b", [2**40 + 3, -5])]
    assert [[type(v) for v in vs] for _, vs in got] == [[type(v) for v in vs] for _, vs in expected]
    assert [type(v) for v in got[1][1]] == [int, int] and len(quick) == 0
