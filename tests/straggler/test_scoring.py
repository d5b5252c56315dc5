"""Rank 0 of the tree exchange scores every rank's timings off the training thread: in a process of its own (the
default) or on a thread. The training thread never waits for work that grows with the number of ranks, and both
places reach the same verdicts (no sleeps: the scoring is held on an event)."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_resilience.step.agreement import Gathered, frame
from lightning_resilience.straggler import StragglerDetector
from lightning_resilience.straggler.config import StragglerConfig
from lightning_resilience.straggler.episodes import Episodes
from lightning_resilience.straggler.exchange import StragglerGatherError, decode_payload, encode_payload
from lightning_resilience.straggler.policy import StragglerFinding
from lightning_resilience.straggler.scoring import ScoringProcess, ScoringThread
from tests.straggler._sim import FakeClock

WORLD = 3


class _Arrived:
    """A gather that has arrived: rank 0's view, as the tree delivers it (its own record, then one blob of the
    other ranks' records)."""

    def __init__(self, value: list[tuple[int, bytes]], step: int | None) -> None:
        self.value = Gathered((frame(value[:1]), frame(value[1:])))
        self.step, self.issued = step, time.perf_counter()

    def done(self) -> bool:
        return True

    def result(self, timeout: Any = None) -> Gathered:
        return self.value


class _Tree:
    """Rank 0 of a tree of ``WORLD`` ranks whose other ranks send rank 0's timings; rank ``slow``'s are ``factor``
    times longer from step ``onset`` on."""

    group = SimpleNamespace(rank=0, world_size=WORLD)

    def __init__(self, slow: int | None = None, factor: float = 1.0, onset: int = 0) -> None:
        self.gathers, self.slow, self.factor, self.onset = 0, slow, factor, onset

    def gather(self, body: bytes, *, op: str, step: int | None = None) -> _Arrived:
        self.gathers += 1
        bodies = []
        for r in range(WORLD):
            payload = decode_payload(body)
            payload["rank"] = r
            if r == self.slow:
                payload["times"] = [
                    {k: v * self.factor for k, v in row.items()} if at >= self.onset else row
                    for at, row in zip(payload["steps"], payload["times"])
                ]
            bodies.append((r, encode_payload(payload)))
        return _Arrived(bodies, step)


def _detector(place: str, tree: _Tree, clock: FakeClock, **kw: Any) -> StragglerDetector:
    config = StragglerConfig(warmup_steps=2, gather_every_n_steps=2, scoring=place, **kw)
    return StragglerDetector.with_tree(config, tree, clock=clock)  # type: ignore[arg-type]


class _Steps:
    def __init__(self, detector: StragglerDetector, clock: FakeClock) -> None:
        self.detector, self.clock, self.step = detector, clock, 0

    def __call__(self, seconds: float = 0.1) -> None:
        self.detector.start_step()
        self.clock.advance(seconds)
        self.detector.end_step(self.step)
        self.step += 1


@pytest.mark.parametrize("place", ["process", "thread"])
def test_the_training_thread_does_not_wait_for_rank_0s_scoring(place: str) -> None:
    clock, tree = FakeClock(), _Tree()
    detector = _detector(place, tree, clock)
    # made before the scorer forks, so the scoring process shares them
    ctx = multiprocessing.get_context("fork")
    release, entered, scored_in = ctx.Event(), ctx.Event(), ctx.Value("i", 0)
    scored_on: list[str] = []
    consume = detector.consume

    def held(step: int, payloads: Any) -> Any:
        scored_in.value = os.getpid()
        scored_on.append(threading.current_thread().name)
        entered.set()
        assert release.wait(30), "the scoring was never released"
        return consume(step, payloads)

    detector.consume = held  # type: ignore[method-assign]
    one_step = _Steps(detector, clock)
    while tree.gathers < 2:  # the first exchange is taken (handed to the scorer) when the second is issued
        one_step()
    assert entered.wait(30) and detector.scoring
    for _ in range(6):  # steps go on while the scoring is held; their exchanges queue behind it
        one_step()
    assert detector.scoring and detector.gathers == 0
    release.set()
    detector.drain()
    assert not detector.scoring and detector.gathers >= 1
    scorer = detector._scorer
    if place == "process":
        assert isinstance(scorer, ScoringProcess)
        assert scored_in.value == scorer.pid != os.getpid()  # another interpreter: the training one's lock is free
        assert not scored_on  # nothing scored on a thread of this process
    else:
        assert isinstance(scorer, ScoringThread) and scored_in.value == os.getpid()
        assert scored_on and all(name.startswith("straggler-scoring") for name in scored_on)
        assert threading.current_thread().name not in scored_on
    detector.close()  # drains what is left and stops the scorer
    assert not any(t.name.startswith("straggler-scoring") for t in threading.enumerate())
    if place == "process":
        assert isinstance(scorer, ScoringProcess) and not scorer._process.is_alive()


def _run(place: str, steps: int) -> StragglerDetector:
    clock, tree = FakeClock(), _Tree(slow=2, factor=1.5, onset=steps // 2)
    detector = _detector(place, tree, clock)
    one_step = _Steps(detector, clock)
    for i in range(steps):
        one_step(0.1 * (1 + 0.01 * (i % 3)))
    detector.drain()
    return detector


def test_a_scoring_process_reaches_the_thread_s_verdicts_and_report() -> None:
    by_thread, by_process = _run("thread", 60), _run("process", 60)
    try:
        assert by_thread.verdicts, "the slow rank was never named: the comparison would be empty"
        assert [v.to_dict() for v in by_process.verdicts] == [v.to_dict() for v in by_thread.verdicts]
        assert [d.to_dict() for d in by_process.decisions] == [d.to_dict() for d in by_thread.decisions]
        assert by_process.gathers == by_thread.gathers
        history = [
            [(step, {k: v.tolist() for k, v in t.items()}) for step, t in d.history] for d in (by_process, by_thread)
        ]
        assert json.dumps(history[0]) == json.dumps(history[1])  # NaN: not timed
        assert by_process.scores() == by_thread.scores()
        reports = [d.report() for d in (by_process, by_thread)]
        for report in reports:
            report.pop("gather_seconds")  # wall time on this machine
        assert json.dumps(reports[0]) == json.dumps(reports[1])
    finally:
        by_thread.close()
        by_process.close()


def test_a_dead_scoring_process_is_an_error_that_names_it_and_close_still_returns() -> None:
    clock, tree = FakeClock(), _Tree()
    detector = _detector("process", tree, clock, gather_timeout_s=30)
    one_step = _Steps(detector, clock)
    while tree.gathers < 2:
        one_step()
    scorer = detector._scorer
    assert isinstance(scorer, ScoringProcess) and scorer.pid is not None
    detector.drain()
    os.kill(scorer.pid, signal.SIGKILL)
    scorer._process.join(30)
    gathers = tree.gathers
    with pytest.raises(StragglerGatherError, match=rf"scoring process \(pid {scorer.pid}\) is gone"):
        while tree.gathers < gathers + 2:  # the next exchange is handed to a process that is gone
            one_step()
    detector.close()  # logs it, does not raise: a fit's end must not fail on the report's scorer


def test_an_error_in_the_scoring_process_reaches_the_training_process() -> None:
    clock, tree = FakeClock(), _Tree()
    detector = _detector("process", tree, clock)

    def broken(step: int, payloads: Any) -> Any:
        raise ValueError("scoring bug")

    detector.consume = broken  # type: ignore[method-assign]
    one_step = _Steps(detector, clock)
    while tree.gathers < 2:
        one_step()
    with pytest.raises(StragglerGatherError, match="ValueError: scoring bug"):
        detector.drain()
    detector._scorer.close()  # type: ignore[union-attr]


_ORPHAN_SCRIPT = """
import json, sys
from tests.straggler.test_scoring import FakeClock, _Steps, _Tree, _detector
clock, tree = FakeClock(), _Tree()
detector = _detector("process", tree, clock)
print(detector.start_scorer().pid, flush=True)
sys.stdin.read()  # until the test kills this process
"""


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux)")
def test_the_scoring_process_dies_with_its_rank() -> None:
    """A rank killed outright (SIGKILL: no teardown, no atexit) leaves no scoring process behind holding copies of
    its sockets."""
    import select
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    rank = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert rank.stdout is not None
        child = int(rank.stdout.readline())
        fd = os.pidfd_open(child)
        try:
            ready, _, _ = select.select([fd], [], [], 0)
            assert not ready, "the scoring process exited before its rank"
            rank.kill()
            rank.wait(30)
            ready, _, _ = select.select([fd], [], [], 30)  # readable once the process has exited
            assert ready, f"scoring process {child} outlived its killed rank"
        finally:
            os.close(fd)
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait(30)


def test_shared_blobs_go_by_descriptor_and_the_scores_come_back_mapped() -> None:
    """Rank 0's large blobs (received into shared memory) reach the scoring process by their descriptors, its own
    small record as bytes, in order; the scoreboard's N-wide arrays come back in shared memory the training process
    maps (copy on write), not as a pickle it reads and unpickles under its interpreter lock."""
    import hashlib
    import mmap

    import numpy as np

    from lightning_resilience.links import SharedBuffer
    from lightning_resilience.straggler.scoring import Scored

    small = frame([(0, b"mine")])
    big = SharedBuffer.holding(frame([(r, b"%05d" % r * 40) for r in range(1, 2000)]))  # 400 KB

    episodes = Episodes(StragglerConfig(), rank=0)

    def score(step: int, blobs: list[Any]) -> Scored:
        kinds = [type(b).__name__ for b in blobs]
        digest = hashlib.sha256(b"".join(blobs)).hexdigest()
        relative = np.arange(7 * 3000, dtype=np.float64).reshape(7, 3000) * step
        if step == 5:  # the same after steps 3 and 4, one more after step 5
            episodes.verdicts.append(_finding(7, 5))
        return Scored([kinds, digest], episodes, step, step, (relative, relative + 1, 2.5))

    scorer = ScoringProcess(score, lambda: None, timeout_s=30)
    try:
        scorer.submit(3, [small, big])
        scorer.submit(4, [small])
        scorer.submit(5, [small])
        first, second, third = scorer.take(wait=True)
    finally:
        scorer.close()
    # the episodes come back as what changed in them: one copy in the training process, brought up to date in order
    assert first.episodes is second.episodes is third.episodes and third.episodes is not episodes
    assert third.episodes.verdicts == [_finding(7, 5)]
    assert first.decisions == [["bytes", "mmap"], hashlib.sha256(small + big[:]).hexdigest()]
    assert second.decisions[0] == ["bytes"]
    expected = np.arange(7 * 3000, dtype=np.float64).reshape(7, 3000) * 3
    relative, individual, job = first.scores
    assert np.array_equal(relative, expected) and np.array_equal(individual, expected + 1) and job == 2.5
    base = relative
    while isinstance(base, np.ndarray | memoryview):
        base = base.obj if isinstance(base, memoryview) else base.base
    assert isinstance(base, mmap.mmap)  # a view on the mapping: nothing copied on the training side
    relative[0, 0] = -1.0  # the rank's own copy (copy on write)
    assert np.array_equal(second.scores[0], expected / 3 * 4)


def test_an_exchange_of_small_blobs_is_one_send_to_the_scoring_process() -> None:
    """The sender thread's sends each release and retake the interpreter lock, which the training thread may be made
    to wait for: an exchange's small blobs ride in its first message; only a large one without shared memory follows
    on its own."""
    from lightning_resilience.straggler import scoring

    class Conn:
        def __init__(self) -> None:
            self.sent: list[Any] = []

        def send(self, message: Any) -> None:
            self.sent.append(message)

        def send_bytes(self, data: bytes) -> None:
            self.sent.append(("bytes", len(data)))

    small = [frame([(r, b"%05d" % r * 40)]) for r in range(4)]
    conn = Conn()
    scoring._send_blobs(conn, None, 7, small)  # type: ignore[arg-type]  # no shared blob: no descriptor to send
    assert conn.sent == [("score", 7, [scoring._INLINE] * 4, small)]
    large = b"x" * scoring.INLINE_BLOB_BYTES
    conn = Conn()
    scoring._send_blobs(conn, None, 8, [small[0], large, small[1]])  # type: ignore[arg-type]
    assert conn.sent == [
        ("score", 8, [scoring._INLINE, scoring._AFTER, scoring._INLINE], [small[0], small[1]]),
        ("bytes", len(large)),
    ]


def test_a_large_exchange_is_handed_over_while_the_scorer_is_busy() -> None:
    """At thousands of ranks an exchange is megabytes, more than a pipe holds: handing it over must not wait for the
    child to read it (here the child is held inside the previous exchange)."""
    import numpy as np

    from lightning_resilience.straggler.scoring import Scored

    ctx = multiprocessing.get_context("fork")
    release, entered = ctx.Event(), ctx.Event()
    episodes = Episodes(StragglerConfig(), rank=0)

    def score(step: int, bodies: list[bytes]) -> Scored:
        entered.set()
        assert release.wait(30), "the scoring was never released"
        return Scored([], episodes, step, step, (np.zeros(1), np.zeros(1), sum(map(len, bodies))))

    scorer = ScoringProcess(score, lambda: None, timeout_s=30)
    try:
        scorer.submit(0, [b"{}"])
        assert entered.wait(30)
        handed = threading.Event()
        big = [b"x" * (1 << 20)] * 4  # 4 MiB

        def submit() -> None:
            scorer.submit(1, big)
            handed.set()

        threading.Thread(target=submit, daemon=True).start()
        assert handed.wait(30), "the training thread waited for the busy scorer to read the exchange"
        release.set()
        scored = scorer.take(wait=True)
        assert [s.gathers for s in scored] == [0, 1] and scored[1].scores[2] == 4 << 20
    finally:
        release.set()
        scorer.close()


@pytest.mark.parametrize("memfds", [False, True])
def test_without_memfds_or_with_a_few_ranks_the_scores_come_back_in_the_reply(
    monkeypatch: pytest.MonkeyPatch, memfds: bool
) -> None:
    """A platform without memfds (not Linux) still gets its scores back: in the pickled reply, not a mapping; and so
    do the small score arrays of a few hundred ranks (no shared buffer, no descriptor, no mapping)."""
    import numpy as np

    from lightning_resilience.straggler import scoring
    from lightning_resilience.straggler.scoring import Scored

    monkeypatch.setattr(scoring, "SHARED_MEMORY", memfds)  # before the fork: the scoring process has none either
    landed: list[Any] = []
    real = scoring._land_scores
    monkeypatch.setattr(scoring, "_land_scores", lambda *args: landed.append(args[2]) or real(*args))
    episodes = Episodes(StragglerConfig(), rank=0)

    def score(step: int, blobs: list[Any]) -> Scored:
        episodes.noise_level_count = step
        return Scored([], episodes, step, step, (np.full((2, 3), float(step)), np.zeros((2, 3)), 1.0))

    scorer = ScoringProcess(score, lambda: None, timeout_s=30)
    try:
        scorer.submit(7, [frame([(0, b"mine")])])
        (scored,) = scorer.take(wait=True)
    finally:
        scorer.close()
    assert np.array_equal(scored.scores[0], np.full((2, 3), 7.0)) and scored.episodes.noise_level_count == 7
    assert landed == [None]  # no shared buffer came with the reply


def _finding(rank: int, step: int) -> StragglerFinding:
    return StragglerFinding(rank=rank, node=f"n{rank}", node_index=rank, section="compute", slowdown=1.02,
                            score="relative", step=step, onset_step=step - 5)  # fmt: skip


def test_the_episodes_travel_as_what_changed_never_the_runs_history() -> None:
    """Between the scoring process and the training process: the whole episodes once, then what each exchange added
    (a long run's thousands of noise-level confirmations are never sent, nor pickled, again); the copy ends equal."""
    scorer = Episodes(StragglerConfig(), rank=0)
    scorer.noise_level += [_finding(r % 64, 10 + r) for r in range(5000)]  # a long run's history
    first, mark = scorer.changes(None)
    assert first is not None
    trained = pickle.loads(pickle.dumps(first)).apply_to(None)  # through the pipe
    whole_bytes = len(pickle.dumps(first))
    assert scorer.changes(mark) == (None, mark)  # nothing new: nothing sent
    scorer.noise_level.append(_finding(3, 6000))
    verdict = _finding(7, 6010)
    scorer.verdicts.append(verdict)
    scorer.ladder.start(verdict)  # an episode under way: the ladders (the rest) changed
    changes, mark = scorer.changes(mark)
    assert changes is not None and changes.rest is not None and changes.whole is None
    sent = pickle.dumps(changes)
    assert len(sent) < 4096 < whole_bytes // 50, (len(sent), whole_bytes)
    trained = pickle.loads(sent).apply_to(trained)
    assert (trained.verdicts, trained.noise_level, trained.active) == (scorer.verdicts, scorer.noise_level, [verdict])
    scorer.ladder.end(7, "compute")
    changes, mark = scorer.changes(mark)
    assert changes is not None and (changes.verdicts, changes.noise_level, changes.decisions) == ([], [], [])
    assert pickle.loads(pickle.dumps(changes)).apply_to(trained).active == []
    scorer.verdicts.append(_finding(1, 6100))
    later, _ = scorer.changes(mark)
    assert later is not None and later.rest is None  # only a finding: the ladders are not sent again
    with pytest.raises(RuntimeError, match="arrived after"):  # a reply lost on the way is never papered over
        later.apply_to(Episodes(StragglerConfig(), rank=0))
