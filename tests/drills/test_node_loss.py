"""Node-loss drill under ``torchrun``: both ranks of one (simulated) node die with their RAM and disk; the job
resumes from the copies their peers hold in RAM, at the newest step, bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._ranks import free_port
from tests.drills.test_torchrun_kill import DRILL_SEED, ROOT, _assert_bitwise_equal, _reports

SCRIPT = ROOT / "tests" / "drills" / "_node_loss_script.py"
STEPS, WORLD = 20, 4
TIMEOUT_S = 240

pytestmark = pytest.mark.slow


def _torchrun(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--max-restarts", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(SCRIPT),
        "--run-dir", str(run_dir), "--steps", str(STEPS), *args,
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # see tests/drills/test_torchrun_kill.py
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    (run_dir / "torchrun.log").write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    assert proc.returncode == 0, f"torchrun failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}"
    return proc


def test_lost_node_resumes_from_peer_ram_bitwise_exact(tmp_path: Path) -> None:
    _torchrun(tmp_path / "reference")
    reference = torch.load(tmp_path / "reference" / "weights.pt", weights_only=True)

    lose_at = random.Random(DRILL_SEED).randint(14, 18)
    run = tmp_path / "drill"
    proc = _torchrun(run, "--lose-node-at-step", str(lose_at))
    assert "(node 1) lost at step" in proc.stdout  # the second kill may come after torchrun stopped the job

    # what node 0 held when node 1 died: its own ranks' shards and the copies of node 1's
    held = {int(k): v for k, v in json.loads((run / "node0_before_loss.json").read_text()).items()}
    complete = set.intersection(*(set(held.get(r, [])) for r in range(WORLD)))
    newest = max(complete)
    assert newest > 10, f"the peer copies should be newer than the disk step 10: {held}"

    reports = _reports(run)
    resumed = [reports[(1, r)] for r in range(WORLD)]
    assert [r["final_step"] for r in resumed] == [STEPS] * WORLD
    assert all(r["restored_step"] == newest and r["restored_from"] == "peer" for r in resumed), resumed
    for rank in (2, 3):  # node 1's ranks got their shards from the lowest rank of node 0
        peer = json.loads((run / f"peer1_rank{rank}.json").read_text())
        assert [newest, rank, 0] in peer["recovered"], peer
    _assert_bitwise_equal(torch.load(run / "weights.pt", weights_only=True), reference)
