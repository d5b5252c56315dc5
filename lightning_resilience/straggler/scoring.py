"""Where rank 0 of the tree exchange scores every rank's timings: in a process of its own (the default), or on a
thread of the training process.

Scoring is Python and many small NumPy calls; on a thread it holds the training process's interpreter lock for as
long as it runs. Whenever the training thread wants the lock meanwhile (between two operators, on its way to the next
batch) it waits, up to the interpreter's switch interval (5 ms), so the scoring lands on the training step anyway:
measured on 2 CPU ranks, 3 ms per exchange of 10 steps, about 0.3 ms a step of a 70 ms step. A process has its
own interpreter: the training process only sends the exchanged bytes and reads back the decisions.

Both places take the same calls (:class:`Scorer`): ``submit`` an exchange as it reached rank 0 (the gathered
blobs, unparsed; never waiting: a thread of the training process hands them to the scoring process in one or two
sends, the large ones received into shared memory by their descriptors, the small ones inside the first message; no
large blob is copied or pickled under the interpreter lock), ``take`` the finished ones in order (never waiting
unless asked), ``state`` for the report, ``close``. The process is forked from the training process before the first
exchange (at setup), so it starts with the detector as it is then and never imports anything; it dies with its
parent (``PR_SET_PDEATHSIG`` on Linux, and the closed pipe everywhere), ignores the signals the training process
handles, and every wait on it has a deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import multiprocessing
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any, Protocol

import numpy as np

from lightning_resilience._lifetime import die_with_parent
from lightning_resilience.links import SHARED_MEMORY, Blob, SharedBuffer
from lightning_resilience.straggler.episodes import EpisodeMark
from lightning_resilience.straggler.exchange import StragglerGatherError

__all__ = ["Scored", "Scorer", "ScoringProcess", "ScoringThread", "open_scorer"]

log = logging.getLogger(__name__)

ScoreFn = Callable[[int, Sequence[Blob]], "Scored"]
"""Score one exchange: the step it was issued at and the gathered blobs of every rank's encoded payload
(:func:`~lightning_resilience.straggler.exchange.decode_gathered` reads them)."""
StateFn = Callable[[], Any]
"""The scorer's whole state, for the report and the plot (read where the scoring ran)."""


@dataclass
class Scored:
    """What the training process needs after each exchange: the decisions and the state they read."""

    decisions: list[Any]
    episodes: Any
    """The verdicts, the ladders and the decisions so far (an :class:`~.episodes.Episodes`); between the scoring
    process and the training process, what changed in them (an :class:`~.episodes.EpisodeChanges`, or None)."""
    gathers: int
    last_gather_step: int | None
    scores: tuple[np.ndarray, np.ndarray, float]
    """The scoreboard's latest relative and individual slowdowns (section x rank) and job slowdown."""


class Scorer(Protocol):
    """Scores exchanges somewhere other than the training thread."""

    scores_elsewhere: bool
    """The scoring updates a copy of the detector (a process): what it scored must be read back into the rank's."""

    @property
    def pending(self) -> int:
        """Exchanges submitted and not yet taken."""

    def submit(self, step: int, blobs: Sequence[Blob]) -> None: ...

    def take(self, *, wait: bool) -> list[Scored]:
        """The scored exchanges, oldest first: those finished (``wait``: all of them, within the deadline)."""

    def state(self) -> Any:
        """The scorer's whole state (after :meth:`take` with ``wait``); None when nothing was scored since the last
        call (a report, a plot and a close at a fit's end fetch it once)."""

    def close(self) -> None: ...


class ScoringThread:
    """Scores on one thread of the training process (``straggler.scoring: thread``): it updates the detector itself."""

    scores_elsewhere = False

    def __init__(self, score: ScoreFn, state: StateFn, timeout_s: float) -> None:
        self._score, self._state, self._timeout_s = score, state, timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="straggler-scoring")
        self._futures: deque[Future[Scored]] = deque()

    @property
    def pending(self) -> int:
        return len(self._futures)

    def submit(self, step: int, blobs: Sequence[Blob]) -> None:
        self._futures.append(self._pool.submit(self._score, step, blobs))

    def take(self, *, wait: bool) -> list[Scored]:
        out = []
        while self._futures and (wait or self._futures[0].done()):
            out.append(self._futures.popleft().result(timeout=self._timeout_s))
        return out

    def state(self) -> Any:
        return self._state()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class ScoringProcess:
    """Scores in a child process forked now, holding the detector as it is (``straggler.scoring: process``).

    Args:
        score: scores one exchange (runs in the child, on its copy of the detector).
        state: the scorer's whole state (runs in the child).
        timeout_s: longest wait for a result the training process needs (the report's, a close's).
    """

    scores_elsewhere = True

    def __init__(self, score: ScoreFn, state: StateFn, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(
            target=_serve, args=(child, self._conn, score, state), name="straggler-scoring", daemon=True
        )
        with warnings.catch_warnings():  # the child runs NumPy and pickle only, never the parent's other threads
            warnings.filterwarnings(
                "ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning
            )
            self._process.start()
        child.close()
        self._fds = socket.socket(fileno=os.dup(self._conn.fileno()))  # the pipe's socket: the scores' descriptor
        self._episodes: Any = None  # the child's episodes, kept up to date from what changed in each reply
        self._ready = select.poll()  # made once: Connection.poll builds a selector each call (50 us)
        self._ready.register(self._conn.fileno(), select.POLLIN)
        self._pending = 0
        self._scored_since_state = False
        # a thread of its own writes to the pipe: an exchange of N records is megabytes at thousands of ranks, more
        # than the pipe holds, and the training thread must not wait for the child to read it
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._send_error: OSError | None = None
        self._sender = threading.Thread(target=self._send_all, name="straggler-scoring-send", daemon=True)
        self._sender.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, step: int, blobs: Sequence[Blob]) -> None:
        self._outbox.put(("score", step, tuple(blobs)))
        self._pending += 1

    def take(self, *, wait: bool) -> list[Scored]:
        out = []
        while self._pending and (wait or self._ready.poll(0)):
            scored = _land_scores(self._fds, *self._receive("scored"))
            if scored.episodes is not None:  # what changed since the last reply: the copy here brought up to date
                self._episodes = scored.episodes.apply_to(self._episodes)
            scored = dataclasses.replace(scored, episodes=self._episodes)
            out.append(scored)
            self._pending -= 1
            self._scored_since_state = True
        return out

    def state(self) -> Any:
        self.take(wait=True)
        if not self._scored_since_state:
            return None
        self._outbox.put(("state",))
        self._scored_since_state = False
        return self._receive("state")

    def close(self) -> None:
        self._outbox.put(("close",))
        self._outbox.put(None)
        self._sender.join(timeout=self._timeout_s)
        self._process.join(timeout=self._timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)
        self._conn.close()
        self._fds.close()

    def _send_all(self) -> None:
        """The sender thread: the messages in order, until the sentinel or a pipe that is gone."""
        with socket.socket(fileno=os.dup(self._conn.fileno())) as sock:  # the pipe's socket, for descriptors
            while (message := self._outbox.get()) is not None:
                try:
                    if message[0] == "score":
                        _send_blobs(self._conn, sock, message[1], message[2])
                        continue
                    self._conn.send(message)
                except OSError as err:  # the child is gone: the next result read says so
                    self._send_error = err
                    return

    def _receive(self, kind: str) -> Any:
        deadline = time.monotonic() + self._timeout_s
        while not self._ready.poll(500):  # at once when the answer is there (ms; Connection.poll makes a selector)
            if not self._process.is_alive() and not self._conn.poll():
                raise self._gone(f"it exited with code {self._process.exitcode}")
            if self._send_error is not None:
                raise self._gone(f"cannot reach it ({self._send_error})")
            if time.monotonic() > deadline:
                raise self._gone(f"no answer within {self._timeout_s:.0f} s")
        try:
            got, value = self._conn.recv()
        except EOFError as err:
            raise self._gone(f"it exited with code {self._process.exitcode}") from err
        if got == "error":
            raise StragglerGatherError(
                f"straggler: rank 0's scoring process failed:\n{value}", op="straggler.scoring", group="straggler"
            )
        assert got == kind, f"straggler scoring: expected {kind!r}, got {got!r}"
        return value

    def _gone(self, why: str) -> StragglerGatherError:
        return StragglerGatherError(
            f"straggler: rank 0's scoring process (pid {self._process.pid}) is gone: {why}",
            op="straggler.scoring",
            group="straggler",
        )


def _serve(conn: Any, parent_end: Any, score: ScoreFn, state: StateFn) -> None:
    """The child: score what arrives until the pipe closes or the parent asks it to stop."""
    parent_end.close()
    die_with_parent()
    _yield_to_training()
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)  # the training process's handlers (preemption, dumps) are not ours
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which closes this process
    code = 0
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    sent: list[EpisodeMark] = []  # the mark of the episodes last shipped
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break  # the parent is gone
            if message[0] == "close":
                break
            try:
                if message[0] == "score":
                    scored, shipped = _ship_scores(_score_received(conn, sock, message, score), sent)
                    reply: tuple[str, Any] = ("scored", (scored, shipped and shipped.shapes))
                else:
                    reply, shipped = ("state", state()), None
            except Exception:  # sent to the parent, which raises it
                reply, shipped = ("error", traceback.format_exc()), None
            conn.send(reply)
            if shipped is not None:
                reduction.sendfds(sock, [shipped.buffer.fd])
    except BaseException:  # a child must never run the parent's exit path
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


_INLINE, _SHARED, _AFTER = 0, 1, 2
"""How :func:`_send_blobs` sends a blob: in its first message (below :data:`INLINE_BLOB_BYTES`), by descriptor (a
:class:`SharedBuffer`), or as a message of its own after the descriptors (a large one where there is no shared
memory)."""
INLINE_BLOB_BYTES = 1 << 16
"""Blobs below this size travel inside the exchange's first message: a copy of a few KB costs less than a send of
its own, each send being a release and a retake of the interpreter lock that the training thread may wait for."""


def _send_blobs(conn: Any, sock: socket.socket, step: int, blobs: Sequence[Blob]) -> None:
    """One exchange to the scoring process, in two sends at most at any number of ranks: one message with which
    blobs come how and the small ones' bytes, then the shared ones' descriptors (the kernel passes them: megabytes at
    thousands of ranks, never copied); only a large blob where the platform has no shared memory follows as it is."""
    kinds = [
        _SHARED if isinstance(b, SharedBuffer) else _INLINE if len(b) < INLINE_BLOB_BYTES else _AFTER for b in blobs
    ]
    conn.send(("score", step, kinds, [b for b, kind in zip(blobs, kinds) if kind == _INLINE]))
    if _SHARED in kinds:
        reduction.sendfds(sock, [b.fd for b in blobs if isinstance(b, SharedBuffer)])
    for blob, kind in zip(blobs, kinds):
        if kind == _AFTER:
            conn.send_bytes(blob)


def _score_received(conn: Any, sock: socket.socket, message: tuple[Any, ...], score: ScoreFn) -> Scored:
    """In the scoring process: read one exchange as :func:`_send_blobs` sent it, score it, let the mappings go."""
    kinds: list[int] = message[2]
    fds = reduction.recvfds(sock, kinds.count(_SHARED)) if _SHARED in kinds else []
    maps = []
    for fd in fds:
        try:
            maps.append(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
        finally:
            os.close(fd)
    sources = {_SHARED: iter(maps), _INLINE: iter(message[3])}  # in order, as sent; the others follow on the pipe
    blobs = [next(sources[kind]) if kind in sources else conn.recv_bytes() for kind in kinds]
    try:
        return score(message[1], blobs)
    finally:
        for m in maps:
            m.close()


INLINE_SCORES_BYTES = 16 << 10
"""Score arrays up to this size come back in the pickled reply: at a few hundred ranks a shared buffer (a memfd, a
write, a descriptor sent, received and mapped) costs both processes more than the bytes."""


@dataclass
class _Shipped:
    """The scoreboard's arrays of one exchange in shared memory: N values a section, handed over by descriptor."""

    buffer: SharedBuffer
    shapes: list[tuple[tuple[int, ...], str]]


def _ship_scores(scored: Scored, sent: list[EpisodeMark]) -> tuple[Scored, _Shipped | None]:
    """In the scoring process: the score arrays (sections x ranks, megabytes at thousands of ranks) out of the
    pickled reply and into one shared buffer, which the training process maps instead of reading and unpickling;
    the episodes only as what changed since the last reply (``sent``: its mark; the whole episodes the first time),
    None when nothing did: the training process brings its copy up to date. Where the platform has
    no memfds, or the arrays are small (:data:`INLINE_SCORES_BYTES`: a few hundred ranks), they stay in the reply (no
    shipment)."""
    changes, mark = scored.episodes.changes(sent[0] if sent else None)
    scored = dataclasses.replace(scored, episodes=changes)
    sent[:] = [mark]
    if not SHARED_MEMORY or sum(np.asarray(a).nbytes for a in scored.scores[:2]) <= INLINE_SCORES_BYTES:
        return scored, None
    arrays = [np.ascontiguousarray(a) for a in scored.scores[:2]]
    shipped = _Shipped(
        SharedBuffer.holding(b"".join(a.tobytes() for a in arrays)), [(a.shape, a.dtype.str) for a in arrays]
    )
    empty = np.empty(0)
    return dataclasses.replace(scored, scores=(empty, empty, scored.scores[2])), shipped


def _land_scores(sock: socket.socket, scored: Scored, shapes: list[tuple[tuple[int, ...], str]] | None) -> Scored:
    """In the training process: map the shared buffer that follows a reply of :func:`_ship_scores` (copy on
    write: the arrays are the rank's own) and view the arrays in it; nothing is copied (``shapes`` None: the
    arrays came in the reply)."""
    if shapes is None:
        return scored
    (fd,) = reduction.recvfds(sock, 1)
    try:
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    arrays, at = [], 0
    for shape, dtype in shapes:
        count = int(np.prod(shape))
        arrays.append(np.frombuffer(mapped, dtype=dtype, count=count, offset=at).reshape(shape))
        at += count * np.dtype(dtype).itemsize
    return dataclasses.replace(scored, scores=(arrays[0], arrays[1], scored.scores[2]))


def _yield_to_training() -> None:
    """A woken scorer must not preempt the rank's training thread on its core: a batch task (no wake-up preemption)
    at a lower priority, so it runs on idle time first and gets a share of a busy core (about a tenth) otherwise."""
    with contextlib.suppress(OSError, AttributeError):  # Linux only
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    with contextlib.suppress(OSError):
        os.nice(10)


def open_scorer(place: str, score: ScoreFn, state: StateFn, timeout_s: float) -> Scorer:
    """The scorer of ``straggler.scoring``: 'process', or 'thread' (also where this platform cannot fork, or this
    process may not have children: a daemonic one)."""
    if place == "process" and "fork" in multiprocessing.get_all_start_methods():
        try:
            return ScoringProcess(score, state, timeout_s)
        except (AssertionError, OSError) as err:  # a daemonic process, or no resources left to fork
            log.warning("straggler: scoring on a thread of the training process (no scoring process: %s)", err)
    return ScoringThread(score, state, timeout_s)
