"""Elastic membership: a job checkpointed on 4 ranks continues on 2 (and back on 4) under ``torchrun``: the
checkpoint is resharded for the new world size and the data position is remapped, so training goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._ranks import free_port
from tests.drills.test_torchrun_kill import ROOT

SCRIPT = ROOT / "tests" / "drills" / "_elastic_script.py"

pytestmark = pytest.mark.slow


def _torchrun(world: int, ckpt: Path, out: Path, steps: int) -> list[dict]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(SCRIPT),
        "--ckpt-dir", str(ckpt), "--out", str(out), "--steps", str(steps),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads(out.with_name(f"{out.stem}_rank{r}.json").read_text()) for r in range(world)]


def test_four_ranks_then_two_then_four(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"  # a directory every rank can read (a shared file system)
    first = _torchrun(4, ckpt, tmp_path / "a.json", steps=7)
    assert all(r["restored_step"] is None and r["final_step"] == 7 for r in first)

    second = _torchrun(2, ckpt, tmp_path / "b.json", steps=12)
    for r in second:  # the final step of the 4-rank run, resharded for 2 ranks
        assert (r["restored_step"], r["restored_from"], r["final_step"], r["finite"]) == (7, "local", 12, True), r
        assert any("from 1 batches on 4 ranks to 2 batches on 2 ranks" in m for m in r["remaps"]), r["remaps"]

    third = _torchrun(4, ckpt, tmp_path / "c.json", steps=16)
    for r in third:
        assert (r["restored_step"], r["final_step"], r["finite"]) == (12, 16, True), r
