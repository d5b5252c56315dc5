"""Rank 0 of the tree exchange scores every rank's timings on a thread of its own: the training thread never waits for
work that grows with the number of ranks (no processes, no sleeps: the scoring is held on an event)."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace
from typing import Any

from lightning_resilience.straggler import StragglerDetector
from lightning_resilience.straggler.config import StragglerConfig
from tests.straggler._sim import FakeClock

WORLD = 3


class _Arrived:
    """A gather that has arrived: rank 0's view, every rank's body."""

    def __init__(self, value: list[tuple[int, bytes]], step: int | None) -> None:
        self.value, self.step, self.issued = value, step, time.perf_counter()

    def done(self) -> bool:
        return True

    def result(self, timeout: Any = None) -> list[tuple[int, bytes]]:
        return self.value


class _Tree:
    """Rank 0 of a tree of ``WORLD`` ranks whose other ranks send the same timings as rank 0."""

    group = SimpleNamespace(rank=0, world_size=WORLD)

    def __init__(self) -> None:
        self.gathers = 0

    def gather(self, body: bytes, *, op: str, step: int | None = None) -> _Arrived:
        self.gathers += 1
        bodies = []
        for r in range(WORLD):
            payload = json.loads(body)
            payload["rank"] = r
            bodies.append((r, json.dumps(payload).encode()))
        return _Arrived(bodies, step)


def test_the_training_thread_does_not_wait_for_rank_0s_scoring() -> None:
    clock = FakeClock()
    tree = _Tree()
    config = StragglerConfig(warmup_steps=2, gather_every_n_steps=2)
    detector = StragglerDetector.with_tree(config, tree, clock=clock)  # type: ignore[arg-type]
    release, entered, scored_on = threading.Event(), threading.Event(), []
    consume = detector.consume

    def held(step: int, payloads: Any) -> Any:
        scored_on.append(threading.current_thread().name)
        entered.set()
        assert release.wait(30), "the scoring was never released"
        return consume(step, payloads)

    detector.consume = held  # type: ignore[method-assign]
    step = 0

    def one_step() -> None:
        nonlocal step
        detector.start_step()
        clock.advance(0.1)
        detector.end_step(step)
        step += 1

    while tree.gathers < 2:  # the first exchange is taken (handed to the scorer) when the second is issued
        one_step()
    assert entered.wait(30) and detector.scoring
    for _ in range(6):  # steps go on while the scoring is held; their exchanges queue behind it
        one_step()
    assert detector.scoring and detector.gathers == 0
    release.set()
    detector.drain()
    assert not detector.scoring and detector.gathers >= 1
    assert scored_on and all(name.startswith("straggler-scoring") for name in scored_on)
    assert threading.current_thread().name not in scored_on
    detector.close()  # drains what is left and stops the thread
    assert not any(t.name.startswith("straggler-scoring") for t in threading.enumerate())
