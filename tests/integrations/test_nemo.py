"""A stock NeMo example script, unmodified, with the suite switched on by command-line overrides only — against a
real NeMo 3.0 (and the Lightning it pins) in its own venv.

``nemo_example/tiny_regression.py`` is shaped like NeMo's examples (``hydra_runner``, ``exp_manager``, a
``ModelPT`` with a plain ``DataLoader(shuffle=True)``) and imports nothing of ours. ``+resilience=default`` (found
through our Hydra search-path plugin) switches the suite on through the ``callbacks_factory`` entry point, and
NeMo's own ``exp_manager.create_fault_tolerance_callback`` / ``create_straggler_detection_callback`` (which raise in
a plain NeMo 3.0: its ``ptl_resiliency`` import fails) are served by our callbacks. The run is SIGKILLed once a
checkpoint is on disk, launched again with the same command line, and ends bitwise equal to an uninterrupted run.

The venv is made by ``make nemo-venv`` (``.venv-nemo``); the test skips when it is absent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilience.checkpoint.standalone import load_checkpoint_dir

ROOT = Path(__file__).resolve().parents[2]
NEMO_PYTHON = Path(os.environ.get("NEMO_VENV", ROOT / ".venv-nemo")) / "bin" / "python"
EXAMPLE = Path(__file__).with_name("nemo_example") / "tiny_regression.py"
STEPS, PERSIST_EVERY, KILL_AFTER = 200, 10, 60
RUN_TIMEOUT_S = 420

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(
        not NEMO_PYTHON.exists(), reason=f"no NeMo venv at {NEMO_PYTHON.parent.parent} (create it: `make nemo-venv`)"
    ),
]

NEMO_KEYS = [  # NeMo's own resiliency keys, as a NeMo user sets them
    "++exp_manager.create_fault_tolerance_callback=True",
    "++exp_manager.fault_tolerance.calculate_timeouts=False",
    "++exp_manager.create_straggler_detection_callback=True",
    "++exp_manager.straggler_detection_params.gpu_relative_perf_threshold=0.8",
]


def _command(workdir: Path, run: Path, *extra: str) -> list[str]:
    return [
        str(NEMO_PYTHON), str(EXAMPLE), "+resilience=default", f"resilience.run_dir={run}",
        f"resilience.checkpoint.tiers.1.every_n_steps={PERSIST_EVERY}", f"exp_manager.exp_dir={run / 'nemo'}",
        f"trainer.max_steps={STEPS}", *extra,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def _run(workdir: Path, run: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        _command(workdir, run, *extra), cwd=workdir, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    (workdir / f"{run.name}.log").write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    return proc


def _kill_once_committed(workdir: Path, run: Path, step: int, *extra: str) -> int:
    """Launch, wait (bounded) until ``step`` is committed on disk, SIGKILL the process; its return code."""
    manifest = run / "ckpt" / f"step_{step:012d}" / "rank_00000" / "manifest.json"
    log = (workdir / f"{run.name}.killed.log").open("w")
    proc = subprocess.Popen(_command(workdir, run, *extra), cwd=workdir, env=_env(), stdout=log, stderr=log)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # a real process on a real clock: the kill lands wherever training has got to
        proc.send_signal(signal.SIGKILL)
        return proc.wait(timeout=60)
    finally:
        log.close()
        if proc.poll() is None:
            proc.kill()


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    state = load_checkpoint_dir(run / "ckpt" / f"step_{STEPS:012d}", rank=0, world_size=1)
    return {k: v for k, v in state["state_dict"].items()}


def _report(run: Path) -> dict[str, Any]:
    return json.loads((run / "resilience_report.json").read_text())["sections"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("nemo")
    reference = _run(workdir, workdir / "reference")
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    rc = _kill_once_committed(workdir, workdir / "faulty", KILL_AFTER, *NEMO_KEYS)
    resumed = _run(workdir, workdir / "faulty", *NEMO_KEYS)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return {"workdir": workdir, "reference": reference, "killed_rc": rc, "resumed": resumed}


def test_the_override_alone_switches_the_suite_on(runs: dict[str, Any]) -> None:
    out = runs["reference"].stdout + runs["reference"].stderr
    assert "lightning_resilience: enabled by the Hydra overrides: TieredCheckpoint(" in out
    sections = _report(runs["workdir"] / "reference")
    assert {"checkpoint", "fault_tolerance", "straggler_detection", "sdc_verification", "resilience_policy"} <= set(
        sections
    )
    assert sections["checkpoint"]["restored_step"] is None and sections["resilience_policy"]["exit_code"] == 0


def test_nemo_own_resiliency_keys_are_served_by_our_callbacks(runs: dict[str, Any]) -> None:
    out = runs["resumed"].stdout + runs["resumed"].stderr
    assert "NeMo exp_manager: fault tolerance and straggler detection provided by lightning_resilience" in out
    # NeMo's exp_manager added them; the suite keeps them instead of adding its own
    kept = out.split("the Trainer's own ", 1)[1].split(" kept", 1)[0]
    assert sorted(kept.split(", ")) == ["FaultTolerance", "StragglerDetection"], kept
    # NeMo hands the callback its log directory's parent: with resume_if_exists there is no version folder, so
    # that is exp_manager.exp_dir, and both attempts keep one ledger in <exp_dir>/resilience
    exp_dir = runs["workdir"] / "faulty" / "nemo"
    assert sorted(exp_dir.rglob("ft_ledger.json")) == [exp_dir / "resilience" / "ft_ledger.json"]
    sections = _report(runs["workdir"] / "faulty")
    # fault_tolerance.calculate_timeouts=False reached our FaultTolerance: nothing was calibrated
    assert sections["fault_tolerance"]["calibrated"] == dict.fromkeys(sections["fault_tolerance"]["timeouts_s"], False)
    assert sections["straggler_detection"]["gathers"] > 0


def test_a_killed_run_relaunched_ends_bitwise_equal(runs: dict[str, Any]) -> None:
    assert runs["killed_rc"] == -signal.SIGKILL, f"the run finished before the kill ({runs['killed_rc']})"
    restored = _report(runs["workdir"] / "faulty")["checkpoint"]["restored_step"]
    assert restored is not None and KILL_AFTER <= restored < STEPS
    # NeMo's resume_if_exists pointed the Trainer at its own (older) last.ckpt: the newer step of ours won
    out = runs["resumed"].stdout + runs["resumed"].stderr
    assert f"our step {restored} is newer than ckpt_path (step 50)" in out, out[-3000:]
    reference, resumed = _final_weights(runs["workdir"] / "reference"), _final_weights(runs["workdir"] / "faulty")
    assert reference.keys() == resumed.keys()
    differ = [k for k in reference if not torch.equal(reference[k], resumed[k])]
    assert differ == [], f"resumed from step {restored}: {differ} differ from the uninterrupted run"
