"""PersistWorker: results and errors come back on the caller, a dead thread is noticed, every wait is bounded."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from lightning_resilience.checkpoint.errors import CheckpointWorkerError
from lightning_resilience.checkpoint.worker import PersistWorker

pytestmark = pytest.mark.timeout(20)

WAIT = timedelta(seconds=10)
SHORT = timedelta(milliseconds=50)


class _Fatal(BaseException):
    """A BaseException that is not an Exception, like KeyboardInterrupt: it must end the worker thread."""


@pytest.fixture
def worker() -> Iterator[PersistWorker]:
    w = PersistWorker(name="lr-persist-test")
    yield w
    try:
        w.close(timedelta(seconds=2))
    except CheckpointWorkerError:
        pass  # tests that kill the worker leave it dead on purpose


def _blocking_job(release: threading.Event, started: threading.Event, result: Any = "done") -> Callable[[], Any]:
    def job() -> Any:
        started.set()
        assert release.wait(WAIT.total_seconds()), "test never released the job"
        return result

    return job


def _thread(w: PersistWorker) -> threading.Thread:
    thread = w._thread
    assert thread is not None, "the worker thread was never started"
    return thread


def test_results_come_back_through_poll_once(worker: PersistWorker) -> None:
    """Each finished job's return value is handed out by exactly one poll(), in order."""
    assert worker.poll() == []
    worker.submit(lambda: {"step": 1})
    assert worker.wait_idle(WAIT)
    worker.submit(lambda: {"step": 2})
    assert worker.wait_idle(WAIT)
    assert worker.poll() == [{"step": 1}, {"step": 2}]
    assert worker.poll() == []


def test_job_exception_is_reraised_on_next_poll_with_cause(worker: PersistWorker) -> None:
    """An Exception escaping a job surfaces once on the caller as CheckpointWorkerError chaining the original."""
    cause = ValueError("disk said no")

    def job() -> None:
        raise cause

    worker.submit(job)
    # wait_idle itself reports the latched error: the job is over and it failed
    with pytest.raises(CheckpointWorkerError, match="disk said no") as info:
        worker.wait_idle(WAIT)
    assert info.value.__cause__ is cause
    # the error is reported once; the thread survives an Exception and keeps serving jobs
    assert worker.poll() == []
    assert _thread(worker).is_alive()
    worker.submit(lambda: 7)
    assert worker.wait_idle(WAIT)
    assert worker.poll() == [7]


def test_job_exception_is_reraised_by_poll(worker: PersistWorker) -> None:
    """poll() (not only wait_idle) re-raises a latched job error with the cause chained."""
    done = threading.Event()

    def job() -> None:
        done.set()
        raise ValueError("bad shard")

    worker.submit(job)
    assert done.wait(WAIT.total_seconds())
    # the job has raised; wait until the worker latched it (bounded) without consuming it
    with worker._cond:
        assert worker._cond.wait_for(lambda: not worker._running and worker._job is None, WAIT.total_seconds())
    with pytest.raises(CheckpointWorkerError) as info:
        worker.poll()
    assert isinstance(info.value.__cause__, ValueError)
    assert "bad shard" in str(info.value)


def test_job_exception_is_reraised_by_submit(worker: PersistWorker) -> None:
    """submit() refuses new work while an earlier job's error is unreported, raising it with the cause."""

    def job() -> None:
        raise ValueError("boom")

    worker.submit(job)
    with worker._cond:
        assert worker._cond.wait_for(lambda: worker._error is not None, WAIT.total_seconds())
    with pytest.raises(CheckpointWorkerError) as info:
        worker.submit(lambda: None)
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_base_exception_kills_thread_and_is_noticed(worker: PersistWorker) -> None:
    """A job raising SystemExit ends the thread; wait_idle/poll/submit then raise 'died' instead of hanging."""

    def job() -> None:
        raise SystemExit(3)

    worker.submit(job)
    thread = _thread(worker)
    thread.join(WAIT.total_seconds())
    assert not thread.is_alive(), "SystemExit in a job must end the worker thread"
    with pytest.raises(CheckpointWorkerError, match="died"):
        worker.wait_idle(WAIT)
    with pytest.raises(CheckpointWorkerError, match="died"):
        worker.poll()
    with pytest.raises(CheckpointWorkerError, match="died"):
        worker.submit(lambda: None)


def test_wait_idle_notices_death_while_waiting(worker: PersistWorker) -> None:
    """wait_idle already waiting on a job that then kills the thread raises 'died' well before its timeout."""
    started, release = threading.Event(), threading.Event()

    def job() -> None:
        started.set()
        assert release.wait(WAIT.total_seconds())
        raise _Fatal("operator interrupt")

    worker.submit(job)
    assert started.wait(WAIT.total_seconds())
    outcome: list[BaseException | bool] = []

    def waiter() -> None:
        try:
            outcome.append(worker.wait_idle(timedelta(seconds=10)))
        except BaseException as err:
            outcome.append(err)

    # pytest's unraisable/thread-exception plugin would turn the intended thread death into a warning
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(threading, "excepthook", lambda args: None)
        w = threading.Thread(target=waiter)
        w.start()
        release.set()
        _thread(worker).join(WAIT.total_seconds())
        w.join(WAIT.total_seconds())
    assert not w.is_alive(), "wait_idle hung on a dead worker"
    assert len(outcome) == 1
    # either wait_idle saw the death, or it returned before the thread was gone; then poll must see it
    if isinstance(outcome[0], bool):
        with pytest.raises(CheckpointWorkerError, match="died"):
            worker.poll()
    else:
        assert isinstance(outcome[0], CheckpointWorkerError)
        assert "died" in str(outcome[0])


def test_wait_idle_does_not_report_idle_for_a_job_that_killed_the_thread(
    worker: PersistWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a job has ended the thread with a BaseException, wait_idle must not return True ("drained, all good").

    The window between the job raising and the thread being gone (the thread still runs its exception hook) is
    held open deterministically; in it the worker has already lost the in-flight persist.
    """
    in_hook, leave_hook = threading.Event(), threading.Event()

    def hook(args: threading.ExceptHookArgs) -> None:
        in_hook.set()
        leave_hook.wait(WAIT.total_seconds())

    monkeypatch.setattr(threading, "excepthook", hook)

    def job() -> None:
        raise _Fatal("operator interrupt")

    worker.submit(job)
    try:
        assert in_hook.wait(WAIT.total_seconds()), "job never raised"
        with pytest.raises(CheckpointWorkerError, match="died"):
            worker.wait_idle(WAIT)
    finally:
        leave_hook.set()
        _thread(worker).join(WAIT.total_seconds())


def test_submit_while_busy_raises(worker: PersistWorker) -> None:
    """A second submit while a job runs is refused with RuntimeError; busy reflects the running job."""
    started, release = threading.Event(), threading.Event()
    worker.submit(_blocking_job(release, started))
    assert started.wait(WAIT.total_seconds())
    assert worker.busy
    try:
        with pytest.raises(RuntimeError, match="busy"):
            worker.submit(lambda: None)
    finally:
        release.set()
    assert worker.wait_idle(WAIT)
    assert not worker.busy
    assert worker.poll() == ["done"]


def test_wait_idle_times_out_then_succeeds(worker: PersistWorker) -> None:
    """wait_idle returns False while a job is blocked and True once it is released."""
    started, release = threading.Event(), threading.Event()
    worker.submit(_blocking_job(release, started))
    assert started.wait(WAIT.total_seconds())
    try:
        assert worker.wait_idle(SHORT) is False
        assert worker.wait_idle(timedelta(0)) is False
        assert worker.busy
    finally:
        release.set()
    assert worker.wait_idle(WAIT) is True
    assert worker.poll() == ["done"]


def test_close_drains_in_flight_job_and_stops_thread() -> None:
    """close() lets the running job finish (its result is kept), then the thread exits; later submits fail."""
    w = PersistWorker()
    started, release = threading.Event(), threading.Event()
    finished = threading.Event()

    def job() -> str:
        started.set()
        assert release.wait(WAIT.total_seconds())
        finished.set()
        return "persisted"

    w.submit(job)
    assert started.wait(WAIT.total_seconds())
    closed: list[bool] = []
    closer = threading.Thread(target=lambda: closed.append(w.close(WAIT)))
    closer.start()
    release.set()
    closer.join(WAIT.total_seconds())
    assert not closer.is_alive()
    assert closed == [True]
    assert finished.is_set(), "close returned before the in-flight job finished"
    assert not _thread(w).is_alive()
    assert w.poll() == ["persisted"]
    with pytest.raises(RuntimeError, match="closed"):
        w.submit(lambda: None)


def test_close_reports_false_when_job_does_not_finish_in_time() -> None:
    """close() with a job that outlives the timeout returns False instead of blocking."""
    w = PersistWorker()
    started, release = threading.Event(), threading.Event()
    w.submit(_blocking_job(release, started))
    assert started.wait(WAIT.total_seconds())
    try:
        assert w.close(SHORT) is False
    finally:
        release.set()
    _thread(w).join(WAIT.total_seconds())
    assert not _thread(w).is_alive()


def test_close_of_unstarted_worker() -> None:
    """A worker that never ran a job closes immediately and cleanly."""
    w = PersistWorker()
    assert w.close(SHORT) is True
    assert w.poll() == []
