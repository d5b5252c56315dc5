"""Fault drills under ``torchrun``: SIGKILL one rank, let torchelastic restart the job, finish bitwise exact.

Each drill runs ``tests/drills/_train_script.py`` on 2 CPU ranks with ``--max-restarts 3``. The first attempt loses a
rank to SIGKILL (no exception, no clean-up); the restarted attempt must resume on its own from the newest step every
rank committed, never from a half-written shard, and end with exactly the weights of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilience.checkpoint.layout import parse_rank, parse_step
from tests._ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "drills" / "_train_script.py"
STEPS = 20
WORLD_SIZE = 2
PERSIST_EVERY = 5  # the LocalTier cadence of the script
TORCHRUN_TIMEOUT_S = 120
DRILL_SEED = int(os.environ.get("DRILL_SEED", "20241130"))

pytestmark = pytest.mark.slow


def _torchrun(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD_SIZE), "--max-restarts", "3",
        "--master-port", str(free_port()), str(SCRIPT),  # the static rendezvous: the line users type
        "--ckpt-dir", str(run_dir / "ckpt"), "--out", str(run_dir / "weights.pt"), "--steps", str(STEPS), *args,
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OMP_NUM_THREADS": "1",
        # no TORCH_DISABLE_SHARE_RDZV_TCP_STORE: ResilientDDPStrategy keeps each restart's keys apart in the agent's
        # store, which outlives the attempts (docs/launching.md)
    }
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S)
    (run_dir / "torchrun.log").write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    assert proc.returncode == 0, f"torchrun failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}"
    return proc


def _reports(run_dir: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """``(attempt, rank) -> report`` for every attempt the script started."""
    out = {}
    for path in run_dir.glob("attempt*_rank*.json"):
        report = json.loads(path.read_text())
        out[(report["attempt"], report["rank"])] = report
    return out


def _committed(entries: dict[str, list[str]]) -> set[int]:
    """Ranks whose shard of one step is committed (renamed into place); temporaries are not."""
    return {rank for name in entries if (rank := parse_rank(name)) is not None}


def _step(name: str) -> int:
    step = parse_step(name)
    assert step is not None, f"{name} is not a step directory"
    return step


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from the uninterrupted run"


def _check_drill(run_dir: Path, proc: subprocess.CompletedProcess[str], kill_rank: int, kill_step: int) -> int:
    """The invariants every drill shares; returns the step the restarted attempt resumed from."""
    assert f"DRILL: rank {kill_rank} SIGKILL at step {kill_step}" in proc.stdout
    reports = _reports(run_dir)
    # one restart, and it finished: the kill cost exactly one attempt
    assert sorted(reports) == [(a, r) for a in (0, 1) for r in range(WORLD_SIZE)], sorted(reports)
    assert all("final_step" not in reports[(0, r)] for r in range(WORLD_SIZE))
    resumed = [reports[(1, r)] for r in range(WORLD_SIZE)]
    assert [r["final_step"] for r in resumed] == [STEPS] * WORLD_SIZE
    assert [r["world_size"] for r in resumed] == [WORLD_SIZE] * WORLD_SIZE

    restored = resumed[0]["restored_step"]
    assert all(r["restored_step"] == restored and r["start_step"] == restored for r in resumed)
    assert all(r["restored_from"] == "local" for r in resumed)
    # every PERSIST_EVERY steps, or a little later when a slow persist made the engine defer the next one
    assert restored is not None and 0 < restored <= kill_step

    # what the restart found on disk, before the engine cleaned up: the restored step is the newest one whose
    # shards every rank had committed; a step held only as a temporary on some rank was never trusted
    listing = resumed[0]["listing_before"]
    complete = [_step(name) for name, entries in listing.items() if _committed(entries) == set(range(WORLD_SIZE))]
    assert restored == max(complete), listing
    for name, entries in listing.items():
        for entry in entries:
            if ".tmp-" in entry:  # a rank died writing this step, so it cannot have committed a newer one
                assert _step(name) > restored, f"{name}/{entry} is not newer than the restored step {restored}"

    # the restarted job removed what the killed one left half-written
    leftovers = [str(p) for p in (run_dir / "ckpt").rglob("*") if ".tmp-" in p.name or ".del-" in p.name]
    assert leftovers == []
    print(f"drill: rank {kill_rank} killed at step {kill_step}, resumed from step {restored}; on disk then: {listing}")
    return restored


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    run_dir = tmp_path_factory.mktemp("drill_reference")
    _torchrun(run_dir)
    reports = _reports(run_dir)
    assert sorted(reports) == [(0, r) for r in range(WORLD_SIZE)]  # nothing failed, nothing restarted
    assert all(r["restored_step"] is None and r["final_step"] == STEPS for r in reports.values())
    return torch.load(run_dir / "weights.pt", weights_only=True)


def test_sigkill_one_rank_mid_training_resumes_bitwise_exact(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    kill_step = random.Random(DRILL_SEED).randint(6, 17)
    print(f"drill: DRILL_SEED={DRILL_SEED} -> SIGKILL rank 1 at step {kill_step}")
    proc = _torchrun(tmp_path, "--kill-at-step", str(kill_step), "--kill-rank", "1")

    _check_drill(tmp_path, proc, kill_rank=1, kill_step=kill_step)
    _assert_bitwise_equal(torch.load(tmp_path / "weights.pt", weights_only=True), reference)


def test_sigkill_during_persist_never_trusts_the_partial_shard(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    kill_step, kill_rank = 10, 0
    proc = _torchrun(tmp_path, "--kill-at-step", str(kill_step), "--kill-rank", str(kill_rank), "--kill-during-persist")

    restored = _check_drill(tmp_path, proc, kill_rank=kill_rank, kill_step=kill_step)
    assert restored < kill_step  # step 10 was committed by the other rank only
    # the killed rank left its shard of step 10 half-written: data on disk under a temporary name, no manifest
    entries = _reports(tmp_path)[(1, 0)]["listing_before"][f"step_{kill_step:012d}"]
    partial = [e for e in entries if e.startswith(f".rank_{kill_rank:05d}.tmp-")]
    assert len(partial) == 1, entries
    assert entries[partial[0]] and "manifest.json" not in entries[partial[0]], entries
    assert kill_rank not in _committed(entries)
    _assert_bitwise_equal(torch.load(tmp_path / "weights.pt", weights_only=True), reference)
