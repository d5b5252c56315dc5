"""``lightning-resilience launch`` owns what it keeps ready for warm restarts: SIGKILLed (no clean-up of its own), it
leaves no process behind: not its standby workers, not the ranks forked from them, not torchrun's agents (the
current one and the one started ahead of the next attempt), not torchrun's processes for the ranks.

2 ranks of a standard-library script (it waits once it has told its pid); real processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests._ranks import free_port

pytestmark = pytest.mark.slow

TIMEOUT_S = 120
SCRIPT = """
import os, sys, threading
from pathlib import Path
Path(sys.argv[1], f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
threading.Event().wait(WAIT_S)
""".replace("WAIT_S", str(2 * TIMEOUT_S))


def _launcher() -> list[str]:
    console = Path(sys.executable).parent / "lightning-resilience"
    return [str(console)] if console.exists() else [sys.executable, "-m", "lightning_resilience.cli"]


def _until(done: object, what: str, proc: subprocess.Popen[bytes]) -> None:
    end = time.monotonic() + TIMEOUT_S
    while not done():  # type: ignore[operator]
        assert proc.poll() is None, f"the launcher ended before {what}"
        assert time.monotonic() < end, f"no {what} within {TIMEOUT_S} s"
        time.sleep(0.1)


def test_a_sigkilled_launcher_leaves_no_process_behind(tmp_path: Path) -> None:
    script = tmp_path / "wait.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [*_launcher(), "launch", "--nproc-per-node", "2", "--max-restarts", "1", "--master-port", str(free_port()),
           "--run-dir", str(tmp_path / "run"), str(script), str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LIGHTNING_RESILIENCE", None)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    launcher = psutil.Process(proc.pid)
    tree: list[psutil.Process] = []
    try:
        _until(lambda: all((out / f"rank{r}.pid").exists() for r in (0, 1)), "ranks", proc)
        forks = [psutil.Process(int((out / f"rank{r}.pid").read_text())) for r in (0, 1)]

        def ahead() -> bool:
            return any("--ahead" in p.cmdline() for p in launcher.children())

        _until(ahead, "agent started ahead", proc)
        tree = launcher.children(recursive=True)
        servers = [p for p in launcher.children() if any(part.endswith("fork_server.py") for part in p.cmdline())]
        assert len(servers) == 2 and {f.ppid() for f in forks} == {s.pid for s in servers}  # ranks are forks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=TIMEOUT_S)
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
    finally:
        for p in [launcher, *tree]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if proc.stderr is not None:
            proc.stderr.close()
