"""Standby workers: a rank runs in a fork of a process that imported the script's imports, with exactly what torchrun
gave the rank (environment, argv, directory, streams), ends as it would have, and nothing of it outlives its owner.

Real processes, no torchrun: each test plays torchrun's part (``python -u worker.py SCRIPT``, the rank's variables)
against a standby worker started by :class:`StandbyWorkers`; the scripts import the standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from lightning_resilience.launch import worker
from lightning_resilience.launch.attempt import WORKER
from lightning_resilience.launch.preimport import script_imports
from lightning_resilience.launch.standby import StandbyWorkers, predicted_env
from lightning_resilience.rundir import RunDir

TIMEOUT_S = 60

SCRIPT = """
import json, os, signal, sys, threading
import settings_at_import  # reads RANK when imported, as Lightning's rank_zero_only does
seen = {"argv": sys.argv, "path0": sys.path[0], "name": __name__, "pid": os.getpid(), "ppid": os.getppid(),
        "cwd": os.getcwd(), "env": dict(os.environ), "rank_at_import": settings_at_import.RANK,
        "version": getattr(settings_at_import, "VERSION", 1),
        "imported_before": settings_at_import.IMPORTED_IN != os.getpid()}
print(json.dumps(seen), flush=True)
print("to the rank's stderr", file=sys.stderr, flush=True)
mode = sys.argv[1]
if mode == "exit":
    sys.exit(87)
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "wait":  # until a signal: SIGTERM ends it with 83
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(83))
    print("waiting", flush=True)
    threading.Event().wait(TIMEOUT)
    sys.exit(3)
"""
SETTINGS = """
import os
RANK = os.environ.get("RANK")
IMPORTED_IN = os.getpid()
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "settings_at_import.py").write_text(SETTINGS)
    path = folder / "train.py"
    path.write_text(SCRIPT.replace("TIMEOUT", str(TIMEOUT_S)))
    return path


def _torchrun(script: Path, **more: Any) -> dict[str, Any]:
    return {"training_script": str(script), "training_script_args": [], "module": False, "nnodes": "1", **more}


@pytest.fixture
def standby(script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StandbyWorkers]:
    monkeypatch.chdir(tmp_path)  # the launcher's working directory, which torchrun's ranks have too
    said: list[str] = []
    workers = StandbyWorkers(_torchrun(script), 1, said.append)
    workers.start()
    yield workers
    workers.stop()


def _rank_env(tmp_path: Path, standby: StandbyWorkers, **more: str) -> dict[str, str]:
    """What torchrun gives local rank 0 of a 1-rank job, and what the launcher adds."""
    return {
        **standby.env,  # the launcher's environment, which the standby worker has too
        **standby.attempt_env(),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
        "TORCHELASTIC_RESTART_COUNT": "0",
        worker.RANK_RECORD_ENV: RunDir(tmp_path / "run").launch().rank_record_template(0),
        **more,
    }


def _rank(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """torchrun's part: ``python -u worker.py SCRIPT ARGS`` in a session of its own."""
    cmd = [sys.executable, "-u", str(WORKER), str(tmp_path / "job" / "train.py"), *args]
    return subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _record(tmp_path: Path, rank: int = 0) -> dict[str, Any]:
    return json.loads(RunDir(tmp_path / "run").launch().rank_record(0, rank).read_text())


def test_a_rank_runs_in_a_fork_of_its_standby_worker_with_what_torchrun_gave_it(
    tmp_path: Path, standby: StandbyWorkers
) -> None:
    env = _rank_env(tmp_path, standby)
    rank = _rank(tmp_path, env, "ok")
    out, err = rank.communicate(timeout=TIMEOUT_S)
    assert rank.returncode == 0, err
    seen = json.loads(out.splitlines()[0])  # through the streams torchrun gave the rank (passed to the fork)
    assert "to the rank's stderr" in err
    assert seen["ppid"] in standby.pids() and seen["pid"] != rank.pid  # a fork of the standby worker
    assert seen["imported_before"] and seen["rank_at_import"] == "0"  # its import was done, with the rank's RANK
    expected = {k: v for k, v in env.items() if k != worker.STANDBY_ENV}
    assert seen["env"] == expected  # exactly the rank's environment
    script = str(tmp_path / "job" / "train.py")
    assert (seen["argv"], seen["path0"], seen["name"], seen["cwd"]) == ([script, "ok"], str(tmp_path / "job"),
                                                                          "__main__", str(tmp_path))  # fmt: skip
    record = _record(tmp_path)
    assert (record["start"], record["pid"], record["exit_code"]) == ("standby", seen["pid"], 0)


@pytest.mark.parametrize(("mode", "status"), [("exit", 87), ("kill", -signal.SIGKILL)])
def test_the_rank_ends_as_its_fork_ended(tmp_path: Path, standby: StandbyWorkers, mode: str, status: int) -> None:
    rank = _rank(tmp_path, _rank_env(tmp_path, standby), mode)
    _, err = rank.communicate(timeout=TIMEOUT_S)
    assert rank.returncode == status, err  # what torchrun's agent reads
    assert _record(tmp_path)["start"] == "standby"


def _started(rank: subprocess.Popen[str]) -> dict[str, Any]:
    assert rank.stdout is not None
    seen = json.loads(rank.stdout.readline())
    assert rank.stdout.readline().strip() == "waiting"
    return seen


def test_signals_reach_the_fork_and_it_dies_with_its_stand_in(tmp_path: Path, standby: StandbyWorkers) -> None:
    env = _rank_env(tmp_path, standby)
    rank = _rank(tmp_path, env, "wait")
    _started(rank)
    os.killpg(rank.pid, signal.SIGTERM)  # how torchrun's agent stops a rank
    rank.communicate(timeout=TIMEOUT_S)
    assert rank.returncode == 83  # the script's own SIGTERM handler ran in the fork

    rank = _rank(tmp_path, env, "wait")
    fork = psutil.Process(_started(rank)["pid"])
    os.killpg(rank.pid, signal.SIGKILL)  # torchrun's last resort: the fork cannot outlive it
    rank.communicate(timeout=TIMEOUT_S)
    fork.wait(timeout=TIMEOUT_S)


def test_a_rank_whose_environment_differs_starts_cold_and_says_why(tmp_path: Path, standby: StandbyWorkers) -> None:
    rank = _rank(tmp_path, _rank_env(tmp_path, standby, A_SETTING_OF_THE_USER="1"), "ok")
    out, err = rank.communicate(timeout=TIMEOUT_S)
    assert rank.returncode == 0, err
    assert "cold start: the environment differs from the standby worker's in A_SETTING_OF_THE_USER" in err
    seen = json.loads(out.splitlines()[0])
    assert seen["pid"] == rank.pid and not seen["imported_before"]
    assert _record(tmp_path)["start"] == "cold" and "A_SETTING_OF_THE_USER" in _record(tmp_path)["cold_reason"]


def test_imports_that_leave_a_thread_running_make_every_rank_start_cold(tmp_path: Path, script: Path) -> None:
    (script.parent / "settings_at_import.py").write_text(
        SETTINGS + "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n"
    )
    workers = StandbyWorkers(_torchrun(script), 1, print)
    workers.start()
    try:
        rank = _rank(tmp_path, _rank_env(tmp_path, workers), "ok")
        _, err = rank.communicate(timeout=TIMEOUT_S)
        assert rank.returncode == 0 and "cold start: the imports left 1 threads running" in err, err
    finally:
        workers.stop()


def test_a_rank_variable_read_at_import_is_learnt_for_the_next_attempt(
    tmp_path: Path, script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the standby worker of local rank 0 imported with RANK=0; on the second node of a job the rank is 2
    monkeypatch.chdir(tmp_path)
    workers = StandbyWorkers(_torchrun(script), 1, print)
    workers.start()
    try:
        env = _rank_env(tmp_path, workers, RANK="2")
        first = _rank(tmp_path, env, "ok")
        out, err = first.communicate(timeout=TIMEOUT_S)
        assert first.returncode == 0 and "cold start: the imports read RANK='2' (imported with '0')" in err, err
        assert json.loads(out.splitlines()[0])["rank_at_import"] == "2"  # a cold start reads it itself
        second = _rank(tmp_path, env, "ok")  # the standby worker imported again, with RANK=2
        out, err = second.communicate(timeout=TIMEOUT_S)
        seen = json.loads(out.splitlines()[0])
        assert second.returncode == 0 and seen["imported_before"] and seen["rank_at_import"] == "2", err
        assert _record(tmp_path, rank=2)["start"] == "standby"
    finally:
        workers.stop()


def test_a_module_changed_on_disk_is_imported_again(tmp_path: Path, standby: StandbyWorkers) -> None:
    env = _rank_env(tmp_path, standby)
    first = _rank(tmp_path, env, "ok")
    out, err = first.communicate(timeout=TIMEOUT_S)
    assert json.loads(out.splitlines()[0])["version"] == 1 and first.returncode == 0, err
    settings = tmp_path / "job" / "settings_at_import.py"
    settings.write_text(SETTINGS + "VERSION = 2\n")  # the user fixed something between two attempts
    os.utime(settings, ns=(settings.stat().st_atime_ns, settings.stat().st_mtime_ns + 1_000_000_000))
    second = _rank(tmp_path, env, "ok")  # runs the code on disk: cold, while the standby worker imports again
    out, err = second.communicate(timeout=TIMEOUT_S)
    assert "settings_at_import.py changed since the standby worker imported it" in err
    assert json.loads(out.splitlines()[0])["version"] == 2 and _record(tmp_path)["start"] == "cold"
    third = _rank(tmp_path, env, "ok")
    out, err = third.communicate(timeout=TIMEOUT_S)
    seen = json.loads(out.splitlines()[0])
    assert seen["version"] == 2 and seen["imported_before"] and _record(tmp_path)["start"] == "standby", err


def test_nothing_outlives_the_owner_when_it_stops(tmp_path: Path, standby: StandbyWorkers) -> None:
    rank = _rank(tmp_path, _rank_env(tmp_path, standby), "wait")
    fork = psutil.Process(_started(rank)["pid"])
    servers = [psutil.Process(pid) for pid in standby.pids()]
    standby.stop()  # the launcher ends: a fork still running is SIGKILLed, then the standby workers end
    _, err = rank.communicate(timeout=TIMEOUT_S)
    assert rank.returncode == -signal.SIGKILL, err  # its stand-in ends as the fork did
    _, alive = psutil.wait_procs([fork, *servers], timeout=TIMEOUT_S)
    assert not alive


def test_the_script_imports_are_read_from_its_top_level(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "helpers.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(
        "from __future__ import annotations\n"
        "import json, os.path\n"
        "from typing import TYPE_CHECKING\n"
        "from . import helpers\n"
        "from .helpers import thing\n"
        "try:\n    import tomllib\nexcept ImportError:\n    tomllib = None\n"
        "if TYPE_CHECKING:\n    import decimal\n"
        "def main():\n    import csv\n"
        "class Job:\n    import zlib\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        names = script_imports(["-m", "pkg.train"])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("pkg", None)
    assert names == ["__future__", "__future__.annotations", "json", "os.path", "typing", "typing.TYPE_CHECKING",
                     "pkg", "pkg.helpers", "pkg.helpers.thing", "tomllib"]  # fmt: skip
    assert script_imports([str(tmp_path / "pkg" / "helpers.py")]) == []


def test_the_rank_variables_known_before_the_rendezvous_are_predicted() -> None:
    one_node = predicted_env({"nnodes": "1"}, 1, 4)
    assert one_node == {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "RANK": "1", "GROUP_RANK": "0", "ROLE_RANK": "1",
                        "WORLD_SIZE": "4", "ROLE_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "1"}  # fmt: skip
    static = predicted_env({"nnodes": "2", "rdzv_backend": "static", "node_rank": 1}, 3, 4)
    assert (static["RANK"], static["GROUP_RANK"], static["WORLD_SIZE"]) == ("7", "1", "8")
    elastic = predicted_env({"nnodes": "1:4", "rdzv_backend": "c10d"}, 0, 8)
    assert elastic == {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}  # the node's rank comes from the rendezvous
    assert StandbyWorkers.unavailable({"no_python": True}) is not None
    assert StandbyWorkers.unavailable({"numa_binding": "node"}) is not None
