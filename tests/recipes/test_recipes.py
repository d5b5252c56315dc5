"""Every recipe runs end to end in a subprocess, and the CLI verifies what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_resilience.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_pretrain_gpt_recipe_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    """A first run persists checkpoints (its final step too); a second run with more steps resumes from it."""
    run_dir = tmp_path / "run"
    base = [
        sys.executable,
        "-m",
        "recipes.pretrain_gpt",
        f"run_dir={run_dir}",
        "resilience.checkpoint.tiers.1.every_n_steps=5",
    ]
    first = _run([*base, "trainer.max_steps=12"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = _run([*base, "trainer.max_steps=16"])
    assert second.returncode == 0, second.stderr[-3000:]
    reports = [json.loads(line) for line in (run_dir / "report.jsonl").read_text().splitlines()]
    assert [r["final_step"] for r in reports] == [12, 16]
    assert reports[0]["restored_step"] is None
    assert reports[1]["restored_step"] == 12 and reports[1]["restored_from"] == "local"
    assert cli_main(["verify", str(run_dir / "ckpt")]) == 0


def test_crash_drill_leaves_a_valid_checkpoint(tmp_path: Path) -> None:
    """The crash drill raises mid-run; what was committed before it verifies clean."""
    run_dir = tmp_path / "run"
    proc = _run(
        [
            sys.executable, "-m", "recipes.pretrain_gpt", f"run_dir={run_dir}", "trainer.max_steps=20",
            "resilience.checkpoint.tiers.1.every_n_steps=4", "drill=crash", "drill.step=9",
        ]
    )  # fmt: skip
    assert proc.returncode != 0 and "injected crash at step 9" in proc.stderr
    assert cli_main(["verify", str(run_dir / "ckpt")]) == 0


def test_cli_reports_corruption(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`verify` exits non-zero and names the shard when a byte flips."""
    run_dir = tmp_path / "run"
    proc = _run([sys.executable, "-m", "recipes.pretrain_gpt", f"run_dir={run_dir}", "trainer.max_steps=10"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = next((run_dir / "ckpt").rglob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert cli_main(["verify", str(run_dir / "ckpt")]) == 1
    assert "checksum mismatch" in capsys.readouterr().out
