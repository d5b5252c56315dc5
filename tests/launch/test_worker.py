"""What each rank runs under the launcher: the user's script as ``__main__``, its end recorded."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_resilience.ft import restart
from lightning_resilience.launch import worker
from lightning_resilience.launch.analysis import rank_ends
from lightning_resilience.launch.attempt import WORKER, torchrun_args
from lightning_resilience.rundir import RunDir

SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__}))
mode = sys.argv[1]
if mode == "exit":
    sys.exit(87)
if mode == "raise":
    raise ValueError("bad batch at step 3")
if mode == "hydra":  # what @hydra.main does with an exception
    try:
        raise ValueError("bad batch at step 3")
    except Exception:
        print("Error executing job", file=sys.stderr)
        sys.exit(1)
"""


def test_the_env_names_are_the_ones_restart_reads() -> None:
    assert worker.ATTEMPT_ENV == restart.ATTEMPT_ENV


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    launch = RunDir(tmp_path / "run{x}").launch()  # braces in a path stay as they are
    env = {**os.environ, worker.RANK_RECORD_ENV: launch.rank_record_template(2), "RANK": "1"}
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    proc = subprocess.run(
        [sys.executable, str(WORKER), *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    record = json.loads(launch.rank_record(2, 1).read_text())
    return proc, record


@pytest.mark.parametrize(("mode", "status"), [("ok", 0), ("exit", 87), ("raise", 1), ("hydra", 1)])
def test_a_script_runs_as_main_and_its_end_is_recorded(tmp_path: Path, mode: str, status: int) -> None:
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "train.py"
    script.write_text(SCRIPT)
    proc, record = _run(tmp_path, str(script), mode)
    assert proc.returncode == status, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[0])
    assert seen == {"argv": [str(script), mode], "path0": str(tmp_path / "sub"), "name": "__main__"}
    assert record["rank"] == 1 and record["pid"] > 0 and record["exit_code"] == status
    if mode in ("raise", "hydra"):  # the exception behind an app's sys.exit(1) too
        assert record["exception"] == {"type": "ValueError", "message": "bad batch at step 3"}
    else:
        assert "exception" not in record
    if mode == "raise":
        assert "ValueError: bad batch at step 3" in proc.stderr  # the traceback is printed as usual


def test_a_module_runs_from_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "train_mod.py").write_text(SCRIPT)
    proc, record = _run(tmp_path, "-m", "train_mod", "exit")
    assert proc.returncode == 87 and record["exit_code"] == 87
    assert json.loads(proc.stdout.splitlines()[0])["path0"] == str(tmp_path)


def _torchrun(**kwargs: object) -> dict[str, object]:
    base = {"no_python": False, "run_path": False, "module": False, "training_script": "train.py"}
    return {**base, "training_script_args": ["--lr", "1"], "max_restarts": 3, **kwargs}


def test_torchrun_runs_each_attempt_without_restarts_and_wraps_the_script() -> None:
    args = torchrun_args({"torchrun": _torchrun()})
    assert args.max_restarts == 0 and args.training_script == str(WORKER) and not args.module
    assert args.training_script_args == ["train.py", "--lr", "1"]
    args = torchrun_args({"torchrun": _torchrun(module=True, training_script="pkg.train")})
    assert args.training_script_args == ["-m", "pkg.train", "--lr", "1"]
    plain = torchrun_args({"torchrun": _torchrun(no_python=True, training_script="/bin/train")})
    assert plain.training_script == "/bin/train" and plain.training_script_args == ["--lr", "1"]
    assert isinstance(plain, argparse.Namespace)


def test_rank_ends_merge_what_torchrun_saw_with_what_ranks_recorded() -> None:
    outcome = {
        "result": "failed",
        "failures": {"1": {"exitcode": -9, "local_rank": 1, "pid": 11, "timestamp": 50}, "2": {"exitcode": -6}},
    }
    own = {
        0: {"rank": 0, "pid": 10, "exit_code": 1, "ended_at": 49.0, "exception": {"type": "RuntimeError"}},
        1: {"rank": 1, "pid": 11},  # killed: only its start
        2: {"rank": 2, "exit_code": 87, "ended_at": 48.0},  # it chose 87, then aborted in teardown
        3: {"rank": 3},  # stopped by torchrun's agent
    }
    ends = {e.rank: e for e in rank_ends(outcome, own)}
    assert (ends[0].exit_code, ends[0].signal) == (1, None)
    assert (ends[1].signal, ends[1].exit_code, ends[1].ended_at) == ("SIGKILL", None, 50.0)
    assert (ends[2].exit_code, ends[2].signal, ends[2].teardown_signal) == (87, None, "SIGABRT")
    assert ends[3].stopped_by_launcher and not ends[3].failed


def test_the_worker_puts_back_torchruns_per_attempt_contract() -> None:
    env = {
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        worker.TORCHELASTIC_ENV: json.dumps(
            {"TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RUN_ID": "job-7"}
        ),
    }
    worker.apply_torchelastic_env(env)
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"], env["TORCHELASTIC_RUN_ID"]) == (
        "2",
        "2",
        "job-7",
    )
