"""The NeMo bridge against a real NeMo 3.0 (and the Lightning it pins), run in its own venv.

The venv is made by ``make nemo-venv`` (``.venv-nemo``: nemo-toolkit[core,common-only]==3.0.0 and this package);
the test skips when it is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEMO_PYTHON = Path(os.environ.get("NEMO_VENV", ROOT / ".venv-nemo")) / "bin" / "python"
SCRIPT = Path(__file__).with_name("_nemo_script.py")
CRASH_AT = 13

pytestmark = pytest.mark.skipif(
    not NEMO_PYTHON.exists(), reason=f"no NeMo venv at {NEMO_PYTHON.parent.parent} (create it with `make nemo-venv`)"
)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("nemo")
    out = workdir / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [str(NEMO_PYTHON), str(SCRIPT), "--workdir", str(workdir), "--out", str(out), "--crash-at", str(CRASH_AT)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(320)
def test_nemo_own_fault_tolerance_and_straggler_keys_raise(result: dict[str, Any]) -> None:
    """Why the keys are taken away from NeMo: its exp_manager imports ``ptl_resiliency``, which NVRx no longer ships."""
    assert result["nemo_version"] == "3.0.0"
    native = result["native"]
    assert native["create_fault_tolerance_callback"].startswith("ValueError: FaultToleranceCallback was enabled")
    assert native["create_straggler_detection_callback"].startswith("ValueError: `create_straggler_detection")


@pytest.mark.timeout(320)
def test_crashed_nemo_run_resumes_bitwise_through_tiered_checkpoint(result: dict[str, Any]) -> None:
    crash, resume = result["crash"], result["resume"]
    assert crash["error"] == f"injected crash at step {CRASH_AT}"
    # +resilience=default builds our detectors, then TieredCheckpoint, next to NeMo's own ModelCheckpoint
    for run in (crash, resume):
        names, ours = run["callbacks"], run["ours"]
        assert {"StragglerDetection", "SDCVerification", "FaultTolerance"} <= set(ours)
        assert ours[-1] == "TieredCheckpoint"
        assert "NeMoModelCheckpoint" in names
        assert run["ckpt_path_after_exp_manager"] is None  # resume_if_exists was turned off: we resume, not NeMo
    assert crash["nemo_checkpoints"], "NeMo's ModelCheckpoint kept writing its checkpoints"
    # left to NeMo, resume_if_exists would have loaded its older *last.ckpt and TieredCheckpoint would stand aside
    assert result["nemo_resume_choice"] is not None and result["nemo_resume_choice"].endswith("last.ckpt")
    # the crash step is saved from RAM on the exception, and the new model (other initial weights) resumes from it
    assert (resume["restored_step"], resume["restored_from"]) == (CRASH_AT, "local")
    assert resume["global_step"] == result["steps"] and resume["error"] is None
    assert result["bitwise_equal"], f"resumed weights differ from the reference by {result['max_abs_diff']}"
    assert resume["exit_code"] == 0


@pytest.mark.timeout(320)
def test_translated_keys_reach_our_callbacks_and_log_dir_survives_restart(result: dict[str, Any]) -> None:
    crash, resume = result["crash"], result["resume"]
    # exp_manager.fault_tolerance: initial_rank_heartbeat_timeout 600, rank_heartbeat_timeout 300, safety_factor 4
    timeouts = resume["ft_initial_timeouts_s"]
    assert (timeouts["setup"], timeouts["step"], timeouts["out_of_section"]) == (600.0, 300.0, 300.0)
    assert resume["ft_safety_factor"] == 4.0
    # straggler_detection_params: gpu_relative_perf_threshold 0.8 -> slowdown 1.25; num_gpu_perf_scores_to_log 3
    assert resume["straggler_min_slowdown"] == pytest.approx(1.25)
    assert resume["straggler_max_logged_ranks"] == 3
    assert resume["straggler_gathers"] > 0
    assert resume.get("policy_straggler_action", "alert") == "alert"  # stop_if_detected=False
    # both attempts log to one directory, so the FT ledger holds the crashed attempt and the resumed one
    assert crash["log_dir"] == resume["log_dir"] and crash["ft_run_dir"] == resume["ft_run_dir"]
    attempts = resume["ft_ledger_attempts"]
    assert [(a["start_step"], a["last_step"], a["end_reason"]) for a in attempts] == [
        (0, CRASH_AT, "exception"),
        (CRASH_AT, result["steps"], "finished"),
    ]
