"""A process that ends takes its daemonic children with it, even one that no longer answers SIGTERM: a loader worker
stuck since its fork keeps the handler of the preemption notice it inherited, and ``multiprocessing`` would join it
forever at exit."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil

from lightning_resilience._lifetime import end_daemon_children
from lightning_resilience.ft.watchdog import TimeoutCalibrator, Watchdog

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str) -> subprocess.CompletedProcess[str]:
    """``script`` in a Python of its own (bounded: a process held by its child fails the test, it does not hang)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def _deaf(ready: threading.Event) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    threading.Event().wait(120)


def _plain(ready: threading.Event) -> None:
    ready.set()
    threading.Event().wait(120)


def test_children_that_outlive_sigterm_are_killed_and_the_others_terminated() -> None:
    ctx = multiprocessing.get_context("fork")
    ready = [ctx.Event(), ctx.Event()]
    deaf = ctx.Process(target=_deaf, args=(ready[0],), daemon=True)
    plain = ctx.Process(target=_plain, args=(ready[1],), daemon=True)
    kept = ctx.Process(target=_plain, args=(ctx.Event(),), daemon=False)  # not daemonic: not ours to end
    for p in (deaf, plain, kept):
        p.start()
    try:
        assert all(r.wait(30) for r in ready)
        start = time.monotonic()
        assert end_daemon_children(grace_s=1.0) == [deaf.pid]
        assert time.monotonic() - start < 10
        assert not deaf.is_alive() and deaf.exitcode == -signal.SIGKILL
        assert not plain.is_alive() and plain.exitcode == -signal.SIGTERM
        assert kept.is_alive()
    finally:
        kept.kill()
        kept.join(10)


def test_a_process_with_the_preemption_notice_ends_though_a_child_kept_its_handler(tmp_path: Path) -> None:
    # the child inherits the notice's handler (SIGTERM sets a flag and the child goes on), as a loader worker stuck
    # in its fork does; at the end of the script multiprocessing terminates it and joins it without a bound
    script = textwrap.dedent(
        """
        import multiprocessing, signal, sys, threading
        from lightning_resilience.ft.preemption import PreemptionNotice

        def child():
            threading.Event().wait(120)

        PreemptionNotice([signal.SIGTERM]).install()
        proc = multiprocessing.get_context("fork").Process(target=child, daemon=True)
        proc.start()
        print(proc.pid, flush=True)
        """
    )
    start = time.monotonic()
    done = _run(script)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - start < 30
    child = int(done.stdout.split()[0])
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert "did not end on SIGTERM" in done.stderr and str(child) in done.stderr


def test_a_rank_ended_for_a_hang_takes_its_daemonic_children_with_it(tmp_path: Path) -> None:
    # os._exit runs no exit function: without the hang handler's own ending, the child would outlive the rank
    script = textwrap.dedent(
        f"""
        import multiprocessing, signal, threading
        from pathlib import Path
        from lightning_resilience.ft.watchdog import Hang, HangHandler

        def child():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            threading.Event().wait(120)

        proc = multiprocessing.get_context("fork").Process(target=child, daemon=True)
        proc.start()
        print(proc.pid, flush=True)
        HangHandler(Path({str(tmp_path)!r}), rank=0, attempt=0)(Hang("step", 1, 2.0, 1.0, "initial"))
        """
    )
    done = _run(script)
    from lightning_resilience.exit_codes import ExitCode

    assert done.returncode == int(ExitCode.HANG), done.stderr[-2000:]
    child = int(done.stdout.split()[0])
    gone = psutil.wait_procs([psutil.Process(child)], timeout=10)[1] == [] if psutil.pid_exists(child) else True
    assert gone, f"child {child} outlived the hung rank"


def test_a_child_stuck_in_its_fork_is_killed_and_the_others_are_left() -> None:
    # a hook registered first stalls one child before the watch's own hook runs: as a child stuck in os.fork() does
    script = textwrap.dedent(
        """
        import json, os, signal, subprocess, sys
        if os.environ.get("IDLE"):  # the copy started anew below
            signal.sigwait([signal.SIGUSR2])
        from lightning_resilience._lifetime import StuckForks

        stall = [False]
        os.register_at_fork(after_in_child=lambda: stall[0] and signal.sigwait([signal.SIGUSR2]))
        now = [0.0]
        watch = StuckForks(after_s=1.0, clock=lambda: now[0])
        stall[0] = True
        stuck = os.fork()
        if stuck == 0:
            os._exit(3)  # never reached: killed where it stalls
        stall[0] = False
        ready_r, ready_w = os.pipe()
        told = os.fork()  # every hook runs: it tells
        if told == 0:
            os.write(ready_w, b"1")
            signal.sigwait([signal.SIGUSR2])
        os.read(ready_r, 1)
        # the same program, run again (a launcher starting a rank): not a fork, never watched
        argv = open("/proc/self/cmdline", "rb").read().split(b"\\0")[:-1]
        again = subprocess.Popen(argv, env={**os.environ, "IDLE": "1"})
        first = watch.check()
        now[0] = 1.5
        second = watch.check()
        _, status = os.waitpid(stuck, 0)
        alive = [os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in (told, again.pid)]
        for pid in (told, again.pid):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        print(json.dumps({"first": first, "second": second, "stuck": stuck, "killed": killed, "alive": alive}))
        """
    )
    done = _run(script)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["first"] == [] and out["second"] == [out["stuck"]] and out["killed"], out
    assert out["alive"] == [True, True], out  # the child that told, and the same program started anew
    assert "have not started" in done.stderr


class _Children:
    """Counts the watchdog's checks and lets the test wait for them (no children looked at)."""

    def __init__(self) -> None:
        self.calls = 0
        self.checked = threading.Event()

    def check(self) -> list[int]:
        self.calls += 1
        self.checked.set()
        return []


def test_the_watchdog_thread_looks_for_stuck_children_every_few_seconds() -> None:
    now = [1000.0]
    children = _Children()
    calibrator = TimeoutCalibrator(initial={"step": 50.0})
    dog = Watchdog(calibrator, lambda hang: None, clock=lambda: now[0], max_wait_s=60.0, children=children)
    dog.start()
    try:
        assert children.checked.wait(10)  # at once
        for seconds, calls in ((1.0, 1), (1.5, 2), (0.5, 2), (1.5, 3)):  # every 2 s of the clock
            children.checked.clear()
            now[0] += seconds
            dog.poke()
            if calls > children.calls:
                assert children.checked.wait(10)
            assert children.calls == calls, (seconds, children.calls)
    finally:
        dog.stop()
