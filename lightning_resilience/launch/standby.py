"""What the launcher keeps ready for the next attempt, so that a restart pays neither the imports nor torchrun's start.

* :class:`StandbyWorkers`: per local rank, a process that has imported what the script imports and waits
  (:mod:`.fork_server`); each rank of each attempt runs in a fork of it, with the environment torchrun gives the rank.
* :class:`AgentAhead`: torchrun's agent of the next attempt (:mod:`.attempt`), started while the current attempt
  trains, its imports done, handed the attempt's spec when the attempt starts.

Both are owned by the launcher: stopped by :meth:`stop` at its end, killed with it (``PR_SET_PDEATHSIG``) when it is
SIGKILLed; a forked rank dies with its standby worker and with torchrun's process for it. Where standby workers
cannot be used the launcher says why at start and every rank starts cold.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_resilience._lifetime import die_with_parent
from lightning_resilience.launch import attempt as attempt_module
from lightning_resilience.launch import fork_server
from lightning_resilience.launch.attempt import worker_argv
from lightning_resilience.launch.worker import STANDBY_ENV

__all__ = ["AgentAhead", "StandbyWorkers", "predicted_env"]

_STOP_TIMEOUT_S = 15.0


def _python() -> str:
    return os.getenv("PYTHON_EXEC", sys.executable)  # what torchrun runs the ranks with


def _nodes(nnodes: str) -> tuple[int, int]:
    low, _, high = str(nnodes).partition(":")
    return int(low), int(high or low)


def predicted_env(torchrun: Mapping[str, Any], local_rank: int, nproc: int) -> dict[str, str]:
    """The variables torchrun will give local rank ``local_rank`` that can be known before its rendezvous (a fixed
    node count with a known node rank: one node, or the static rendezvous' ``--node-rank``)."""
    env = {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(nproc)}
    low, high = _nodes(torchrun.get("nnodes") or "1")
    if low != high or (high > 1 and torchrun.get("rdzv_backend") != "static"):
        return env  # the node's rank comes from the rendezvous: learnt from the first attempt
    node = int(torchrun.get("node_rank") or 0) if high > 1 else 0
    rank = node * nproc + local_rank
    return {
        **env,
        "RANK": str(rank),
        "GROUP_RANK": str(node),
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(high * nproc),
        "ROLE_WORLD_SIZE": str(high * nproc),
        "GROUP_WORLD_SIZE": str(high),
    }


class StandbyWorkers:
    """One standby worker (a :mod:`.fork_server` process) per local rank, for the whole launch.

    Args:
        torchrun: torchrun's parsed arguments (the script, its arguments, the node layout).
        nproc: local ranks.
        say: how to tell the user (one line).
    """

    def __init__(self, torchrun: Mapping[str, Any], nproc: int, say: Any) -> None:
        self.torchrun, self.nproc, self._say = torchrun, nproc, say
        self.name = f"lightning-resilience/standby/{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._servers: dict[int, tuple[subprocess.Popen[bytes], int]] = {}  # local rank -> (process, stop pipe)
        self.env = dict(os.environ)
        if "OMP_NUM_THREADS" not in self.env and nproc > 1:
            self.env["OMP_NUM_THREADS"] = "1"  # what torchrun sets for its ranks: the imports see it too

    @staticmethod
    def unavailable(torchrun: Mapping[str, Any]) -> str | None:
        """Why this launch line cannot have standby workers, or None."""
        if not sys.platform.startswith("linux"):
            return "they need Linux (fork, abstract sockets, PR_SET_PDEATHSIG)"
        if torchrun.get("no_python") or torchrun.get("run_path"):
            return "a --no-python or --run-path script is not run by the rank wrapper"
        if torchrun.get("numa_binding"):
            return "--numa-binding binds torchrun's process of each rank, not a forked one"
        return None

    def start(self) -> None:
        for local_rank in range(self.nproc):
            self._start(local_rank)
        self._say(f"standby workers: {self.nproc} processes import what the script imports; each attempt's ranks "
                  "start from them (--no-standby turns them off)")  # fmt: skip

    def _start(self, local_rank: int) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(f"\0{self.name}-{local_rank}")  # abstract: no file to leave behind; same user checked
        listener.listen(64)
        stop_r, stop_w = os.pipe()
        predicted = json.dumps(predicted_env(self.torchrun, local_rank, self.nproc))
        server = str(Path(fork_server.__file__).resolve())
        cmd = [
            _python(),
            "-u",
            server,
            str(listener.fileno()),
            str(stop_r),
            predicted,
            "--",
            *worker_argv(self.torchrun),
        ]
        try:
            proc = subprocess.Popen(
                cmd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                pass_fds=(listener.fileno(), stop_r),
                start_new_session=True,  # no terminal signal reaches it; the launcher ends it
                preexec_fn=lambda: die_with_parent(signal.SIGKILL),
            )
        finally:
            listener.close()  # the server holds it: when it is gone, a rank's connect fails at once
            os.close(stop_r)
        self._servers[local_rank] = (proc, stop_w)

    def attempt_env(self) -> dict[str, str]:
        """For an attempt's ranks: where their standby workers are. A standby worker that ended (killed, OOM) is
        started again, said in the log (its rank starts cold meanwhile: it waits for the imports)."""
        for local_rank, (proc, stop_w) in list(self._servers.items()):
            if proc.poll() is not None:
                self._say(f"standby worker {local_rank} ended (status {proc.returncode}): starting it again")
                os.close(stop_w)
                self._start(local_rank)
        return {STANDBY_ENV: self.name}

    def stop(self) -> None:
        """End every standby worker (they SIGKILL what they forked that still runs); bounded, then SIGKILL."""
        for _, stop_w in self._servers.values():
            with contextlib.suppress(OSError):
                os.close(stop_w)
        for proc, _ in self._servers.values():
            _end(proc, _STOP_TIMEOUT_S)
        self._servers.clear()

    def pids(self) -> list[int]:
        return [proc.pid for proc, _ in self._servers.values()]


def _end(proc: subprocess.Popen[bytes], wait_s: float) -> None:
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=wait_s)


class AgentAhead:
    """torchrun's agent for the next attempt, started ahead of it (:meth:`prepare`) and handed its spec."""

    def __init__(self) -> None:
        self._ahead: tuple[subprocess.Popen[bytes], int] | None = None

    @staticmethod
    def _popen(args: list[str], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, str(Path(attempt_module.__file__).resolve()), *args],
            pass_fds=pass_fds,
            start_new_session=True,  # its own process group: stopped as a whole; Ctrl-C reaches the launcher only
            preexec_fn=lambda: die_with_parent(signal.SIGTERM),
        )

    def prepare(self) -> None:
        """Start the next attempt's agent now: it imports torchrun and waits for its spec."""
        if self._ahead is not None:
            return
        spec_r, spec_w = os.pipe()
        try:
            proc = self._popen(["--ahead", str(spec_r)], pass_fds=(spec_r,))
        finally:
            os.close(spec_r)
        self._ahead = (proc, spec_w)

    def take(self, spec: Path) -> subprocess.Popen[bytes]:
        """The agent of the attempt of ``spec``: the one started ahead when it is still there, else a new one."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            proc, spec_w = ahead
            try:
                if proc.poll() is None:
                    os.write(spec_w, f"{spec}\n".encode())
                    return proc
            except OSError:
                pass
            finally:
                os.close(spec_w)
            _end(proc, _STOP_TIMEOUT_S)
        return self._popen([str(spec)])

    def stop(self) -> None:
        """No next attempt: the agent started ahead reads no spec and ends."""
        if self._ahead is not None:
            proc, spec_w = self._ahead
            self._ahead = None
            os.close(spec_w)
            _end(proc, _STOP_TIMEOUT_S)
