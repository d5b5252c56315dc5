"""The owned background workers that move snapshots to slower tiers.

:class:`PersistWorker`: one thread, one job at a time. The owner polls it on the training thread: results come back
there, an error that escaped a job is re-raised there, and a worker that died is noticed there instead of being
waited on forever. :class:`WriterProcess`: the process that writes a shard's bytes from shared memory for it, off
the training process's GIL. Every wait is bounded.
"""

from __future__ import annotations

import base64
import errno
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning_resilience.checkpoint import shard_writer
from lightning_resilience.checkpoint.errors import CheckpointWorkerError
from lightning_resilience.checkpoint.shard_writer import FilePlan, read_message, send_message

__all__ = ["PersistWorker", "WriterProcess"]

log = logging.getLogger(__name__)

_WRITER_SCRIPT = Path(shard_writer.__file__)
"""Run as a script, not as a module of the package: the package's imports (torch, lightning) stay out of it."""


class PersistWorker:
    """A single background thread that runs persist jobs one at a time.

    Args:
        name: thread name (shows up in stack dumps).
    """

    def __init__(self, name: str = "lr-persist") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._job: Callable[[], Any] | None = None
        self._running = False
        self._results: list[Any] = []
        self._error: BaseException | None = None
        self._died: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._job is not None or self._running

    def _ensure_started(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()

    def _check_alive(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointWorkerError(f"checkpoint persist worker failed: {type(err).__name__}: {err}") from err
        thread_gone = self._thread is not None and not self._thread.is_alive() and not self._closing
        if self._died is not None or thread_gone:
            raise CheckpointWorkerError(
                "checkpoint persist worker died without reporting an error; the last in-flight persist is lost, "
                "earlier committed checkpoints are intact"
            ) from self._died

    def submit(self, job: Callable[[], Any]) -> None:
        """Start ``job`` in the background.

        Raises:
            RuntimeError: the worker is busy (callers check :attr:`busy` first) or closed.
            CheckpointWorkerError: an earlier job failed or the worker died.
        """
        with self._cond:
            self._check_alive()
            if self._closing:
                raise RuntimeError("persist worker is closed")
            if self._job is not None or self._running:
                raise RuntimeError("persist worker is busy; check .busy before submitting")
            self._ensure_started()
            self._job = job
            self._cond.notify_all()

    def poll(self) -> list[Any]:
        """Results of jobs finished since the last poll; re-raises a job's escaped error on the caller."""
        with self._cond:
            self._check_alive()
            results, self._results = self._results, []
            return results

    def wait_idle(self, timeout: timedelta) -> bool:
        """Wait until no job is queued or running. Returns False on timeout; raises if the worker died."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._cond:
            while self._job is not None or self._running:
                self._check_alive()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # wake up periodically: a thread that dies does not notify
                self._cond.wait(min(remaining, 0.5))
            self._check_alive()
            return True

    def close(self, timeout: timedelta) -> bool:
        """Finish the job in flight (bounded), then stop the thread. Returns False if it did not stop in time."""
        idle = True
        try:
            idle = self.wait_idle(timeout)
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join(timeout=max(0.0, timeout.total_seconds()) if idle else 0.1)
        return idle and (self._thread is None or not self._thread.is_alive())

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closing:
                    self._cond.wait()
                if self._job is None:
                    return
                job, self._job = self._job, None
                self._running = True
            try:
                result = job()
            except Exception as err:  # latched, re-raised on the training thread by poll()
                with self._cond:
                    self._error = err
                    self._running = False
                    self._cond.notify_all()
                continue
            except BaseException as err:
                with self._cond:
                    self._died = err  # noticed by the owner even before the thread is gone
                    self._running = False
                    self._cond.notify_all()
                raise
            with self._cond:
                self._results.append(result)
                self._running = False
                self._cond.notify_all()


class WriterProcess:
    """The owned writer process: it writes a shard's data files from a snapshot in shared memory, so that the
    persist (raw bytes, checksums, fsync) does not hold the training process's GIL.

    A small Python process (``shard_writer.py``, no torch import: it starts in tens of milliseconds) that takes one
    request at a time on a pipe. Its owner (the checkpoint manager) starts it and stops it; every wait for it is
    bounded and notices its death; an error it reports is raised in the caller (the persist thread, whose errors
    reach the training thread). It dies with its parent (``PR_SET_PDEATHSIG``, and the end of its stdin), so a
    trainer killed with SIGKILL leaves no writer behind.

    Args:
        timeout: longest wait for one request.
    """

    def __init__(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self.writes = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the process (from a thread that lives as long as it: the death signal follows that thread)."""
        with self._lock:
            self._running()

    def _running(self) -> subprocess.Popen[bytes]:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            if proc is not None:
                log.warning("the checkpoint writer process ended (exit code %s): starting another", proc.returncode)
            # -I: isolated, without the script's directory on the path (its neighbours would shadow nothing, but
            # the writer needs only the standard library and xxhash)
            proc = self._proc = subprocess.Popen(
                [sys.executable, "-I", str(_WRITER_SCRIPT), str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
            )
        return proc

    def write_files(
        self, directory: Path, segment: Path, offsets: list[int], plans: list[FilePlan], extra: dict[str, bytes]
    ) -> dict[str, dict[str, Any]]:
        """See :class:`~lightning_resilience.checkpoint.snapshot.ShardWriter`."""
        request = {
            "op": "write",
            "directory": str(directory),
            "segment": str(segment),
            "offsets": offsets,
            "files": [p.to_json() for p in plans],
            "extra": {name: base64.b64encode(data).decode("ascii") for name, data in extra.items()},
        }
        with self._lock:
            proc = self._running()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                send_message(proc.stdin, request)
                reply = self._reply(proc)
            except (OSError, ValueError) as err:  # a broken pipe, a torn reply, no reply: the writer is gone
                self._kill(proc)
                if isinstance(err, OSError) and err.errno in (errno.EIO, errno.ETIMEDOUT):
                    raise
                raise OSError(errno.EIO, f"the checkpoint writer process failed: {err}") from err
            self.writes += 1
        if reply.get("ok"):
            files: dict[str, dict[str, Any]] = reply["files"]
            return files
        if reply.get("kind") == "OSError":
            raise OSError(reply.get("errno") or errno.EIO, reply.get("error"), reply.get("file"))
        raise RuntimeError(f"checkpoint writer process: {reply.get('kind')}: {reply.get('error')}")

    def _reply(self, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        """The reply to the request just sent; bounded by the timeout, and a dead writer is noticed within 0.5 s."""
        assert proc.stdout is not None
        deadline = time.monotonic() + self._timeout.total_seconds()
        fd = proc.stdout.fileno()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    errno.ETIMEDOUT, f"the checkpoint writer process gave no reply within {self._timeout}"
                )
            ready, _, _ = select.select([fd], [], [], min(remaining, 0.5))
            if ready:
                reply = read_message(proc.stdout)
                if reply is None:
                    raise OSError(errno.EIO, f"the checkpoint writer process ended (exit code {proc.wait(5)})")
                return reply
            if proc.poll() is not None:
                raise OSError(errno.EIO, f"the checkpoint writer process died (exit code {proc.returncode})")

    def close(self, timeout: timedelta) -> bool:
        """Ask the process to end after its request in flight and wait for it (bounded); killed past the bound.
        Returns False if it had to be killed."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return True
        try:
            assert proc.stdin is not None
            send_message(proc.stdin, {"op": "exit"})
            proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            proc.wait(max(timeout.total_seconds(), 0.1))
            clean = True
        except subprocess.TimeoutExpired:
            self._kill(proc)
            clean = False
        if proc.stdout is not None:
            proc.stdout.close()
        return clean

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        proc.kill()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            log.error("checkpoint writer process %d did not die after SIGKILL", proc.pid)
