"""Smoke tests of the shared-memory benchmarks: ``--quick`` runs end to end and writes sane JSON.

No timing assertions: the figures depend on the (shared) machine. The restart breakdown launches a job with a restart
(a minute or two): it runs with ``LR_DRILLS=all`` (``make drills-data``), not in CI.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow]


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def _run(module: str, out: Path, *args: str, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", module, "--quick", "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "| target |" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.timeout(400)
def test_snapshot_cost_and_restore(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    before = set(shm.glob("lr-shm-bench-*"))
    r = _run("benchmarks.shared_memory", tmp_path / "r.json", "--preset", "tiny", "--tmpdir", str(tmp_path),
             timeout=380)  # fmt: skip
    assert set(r["step_time"]) == {"none", "floor", "process", "shared", "process+disk", "shared+disk"}
    assert all(_positive(f["mean_s"]) and len(f["samples_s"]) == f["n"] > 0 for f in r["step_time"].values())
    assert r["step_time"]["floor"]["floor_ratio"] == pytest.approx(1.0)
    for source in ("shared memory", "local disk"):
        assert _positive(r["restore"][source]["median_s"])
    assert [t["verdict"] in ("PASS", "MISS") for t in r["targets"]] == [True] * 3
    assert not list(tmp_path.glob("lr-shm-bench-*")), "the benchmark left its checkpoints behind"
    assert set(shm.glob("lr-shm-bench-*")) == before, "the benchmark left its shared buffers behind"
    assert r["config"]["shm_filesystem"] == "tmpfs"  # where a job keeps them, not a disk the kernel writes back to


@pytest.mark.timeout(700)
@pytest.mark.skipif(os.environ.get("LR_DRILLS") != "all", reason="a launched job with a restart: make drills-data")
def test_restart_breakdown(tmp_path: Path) -> None:
    r = _run("benchmarks.restart_breakdown", tmp_path / "r.json", "--tmpdir", str(tmp_path), timeout=680)
    assert set(r["configs"]) == {"shared", "cold"}  # warm restarts (the default) and --no-standby
    for config in r["configs"].values():
        (run,) = config["runs"]
        assert run["restored_from"] == "memory" and run["steps_lost"] <= 1
        assert sum(run["parts_s"].values()) == pytest.approx(run["total_s"])
        assert _positive(run["parts_s"]["imports"]) and _positive(run["parts_s"]["restore"])
