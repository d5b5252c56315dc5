"""Rank 0 of N ranks for ``benchmarks.exchange_rank0``, run as a script so that the suite comes from whichever source
tree ``PYTHONPATH`` names (this one or an earlier commit's): ``python _exchange_rank0_child.py RANKS STEPS STEP_MS``
prints one JSON line. Imports nothing of ``benchmarks``."""

from __future__ import annotations

import json
import os
import signal
import statistics
import struct
import sys
import time
from array import array
from typing import Any

BLOCK = 50
CHUNK_S = 1e-4
SCORED = 6  # exchanges the scorer's own work is timed on
_SECTIONS = ("backward", "compute", "data", "forward", "optimizer", "step", "wait")
_BASE = {"backward": 0.008, "compute": 0.014, "data": 0.001, "forward": 0.004, "optimizer": 0.002, "step": 0.016,
         "wait": 0.001}  # fmt: skip
"""Seconds per section of a healthy rank; every rank's timings jitter 5% around them (a job's, not noise that
makes the detector name hundreds of ranks and every reply carry their verdicts)."""


def _child(ranks: int, steps: int, step_ms: float) -> dict[str, Any]:
    """Rank 0 of ``ranks`` ranks, in this process; the source tree is whatever ``sys.path`` finds first."""
    import random
    from datetime import timedelta

    import lightning_resilience
    from lightning_resilience import links
    from lightning_resilience.step import agreement
    from lightning_resilience.straggler import StragglerDetector
    from lightning_resilience.straggler.config import StragglerConfig
    from lightning_resilience.straggler.exchange import encode_payload

    frame = getattr(agreement, "frame", None) or agreement._frame  # type: ignore[attr-defined]  # an earlier tree
    rng = random.Random(0)
    config = StragglerConfig()
    every = config.gather_every_n_steps

    unit = _calibrate()
    chunk = max(1, round(CHUNK_S / unit))  # the training thread's work in slices of about 0.1 ms
    per_step = max(1, round(step_ms / 1e3 / (chunk * unit)))
    # the other ranks as healthy as this one: rank 0 times its whole step as compute (no sections, no waits), so
    # theirs is scaled to the step it takes (timed here); else the detector names rank 0 a straggler
    trial = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(per_step):
            _work(chunk)
        trial.append(time.perf_counter() - t)
    scale = statistics.median(trial) / _BASE["compute"]

    def payload(rank: int, first: int = 0) -> bytes:
        times = [{s: scale * _BASE[s] * (1 + 0.05 * rng.gauss(0, 1)) for s in _SECTIONS} for _ in range(every)]
        host, steps = f"node{rank // 8:05d}", list(range(first, first + every))
        return encode_payload({"rank": rank, "host": host, "local_world_size": 8, "steps": steps, "times": times})

    bodies = [payload(r) for r in range(1, ranks)]
    blobs = [frame([(r, bodies[r - 1]) for r in range(1 + i, ranks, 4)]) for i in range(4)]

    # what the children send, in a file of memory, each blob after its size as on a link: a receive is the kernel's
    # copy from it (os.preadv, as recv_into, with the interpreter released) into the buffer the tree's receive uses,
    # then what that receive does with it
    source = os.memfd_create("children")
    offsets = [0]  # where each child's size header starts; its blob follows it
    for blob in blobs:
        end = offsets[-1] + os.pwrite(source, struct.pack("<q", len(blob)), offsets[-1])
        offsets.append(end + os.pwrite(source, blob, end))
    shared = getattr(links, "SharedBuffer", None)  # an earlier tree receives into a bytearray and copies it
    # which payloads land in shared memory: links.lands_shared, or the rule it names (64 KiB or more, since d929264)
    lands_shared = getattr(links, "lands_shared", lambda n: shared is not None and n >= 1 << 16)

    def read(at: int, n: int) -> bytes:
        """links._recv_exact: a zeroed buffer, filled, copied."""
        buf = bytearray(n)
        os.preadv(source, [buf], at)
        return bytes(buf)

    def size(child: int) -> int:
        """The size ahead of a child's blob, read as links read it."""
        return int(struct.unpack("<q", read(offsets[child], 8))[0])

    class RootGroup:
        name, timeout, rank, world_size, distributed = "step", timedelta(seconds=120), 0, ranks, True

        def exchange(self, payload: Any, *, send_to: Any, recv_from: Any, **_: Any) -> list[Any]:
            # an earlier tree's receive of a child's blob: its size, then the blob into bytes
            return [read(offsets[i] + 8, size(i)) for i in range(len(recv_from))]

        def receive(self, recv_from: Any, **_: Any) -> list[Any]:
            out: list[Any] = []
            for i in range(len(recv_from)):  # links.TcpLinks.receive: the size, then the blob where it lands
                n = size(i)
                if not lands_shared(n):
                    out.append(read(offsets[i] + 8, n))
                    continue
                buf = shared(n)  # shared memory, filled by the kernel
                with memoryview(buf) as view:
                    os.preadv(source, [view], offsets[i] + 8)
                out.append(buf)
            return out

    tree = agreement.TreeAgreement(RootGroup())  # type: ignore[arg-type]
    detector = StragglerDetector.with_tree(config, tree)
    scorer = detector.start_scorer()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pid = getattr(scorer, "pid", None)
    if len(cores) >= 2 and pid is not None:  # the scorer on a core of its own: the training thread keeps one
        os.sched_setaffinity(pid, cores[-1:])
    durations = array("d", bytes(8 * steps * per_step))
    hooks = 0.0
    for i in range(steps):
        on = (i // BLOCK) % 2 == 1  # off first: the scorer process is forked, the first exchange not yet issued
        t0 = time.perf_counter()
        if on:
            if i % BLOCK == 0:  # the block off was no wait for data
                detector.timer.reset_data_wait()
            detector.start_step()
        t1 = time.perf_counter()
        at = i * per_step
        for c in range(per_step):
            t = time.perf_counter()
            _work(chunk)
            durations[at + c] = time.perf_counter() - t
        t2 = time.perf_counter()
        if on:
            detector.end_step(i)
            hooks += (t1 - t0) + (time.perf_counter() - t2)
    exchanges = detector.gathers  # no close: it would wait for the scoring of the exchanges still queued
    verdicts = len(detector.verdicts)  # of the exchanges read back: a healthy job has none
    if pid is not None:  # reaped here, so that its CPU counts as the benchmark's own, not another process's
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    # the scorer's own work: a detector of its own scores exchanges of fresh payloads here, on this thread (what the
    # scoring process does with each exchange: read the blobs, score every step of them), timed one by one
    scorer = StragglerDetector(config, rank=0, world_size=ranks, gather=lambda p: [p])
    scoring = []
    for at in range(SCORED):
        first = at * every
        fresh = [frame([(r, payload(r, first)) for r in range(i, ranks, 5)]) for i in range(5)]  # as 5 blobs
        t = time.perf_counter()
        scorer._score_bodies(at * every, fresh)
        scoring.append(time.perf_counter() - t)
    on_steps = [i for i in range(steps) if (i // BLOCK) % 2 == 1]
    off_steps = [i for i in range(steps) if (i // BLOCK) % 2 == 0]
    base = statistics.median(durations[i * per_step + c] for i in off_steps for c in range(per_step))

    def stalls(which: list[int]) -> tuple[float, float]:
        """Time the slices of these steps lost beyond twice their usual length: the thread held up (by the
        interpreter lock, or the scheduler), not the machine's drift; and the longest such hold."""
        lost = [d - base for i in which for d in durations[i * per_step : (i + 1) * per_step] if d > 2 * base]
        return sum(lost) / len(which), max(lost, default=0.0)

    (stall_on, worst_on), (stall_off, worst_off) = stalls(on_steps), stalls(off_steps)
    return {
        "suite": lightning_resilience.__file__,
        "ranks": ranks,
        "slice_s": base,
        "step_s": base * per_step,
        "hooks_s_per_step": hooks / len(on_steps),
        "stall_s_per_step_on": stall_on,
        "stall_s_per_step_off": stall_off,
        "worst_hold_on_s": worst_on,
        "worst_hold_off_s": worst_off,
        "gather_every_n_steps": every,
        "exchanges": exchanges,
        "verdicts": verdicts,
        "bytes_at_rank0": sum(len(b) for b in blobs),
        "bytes_per_rank": statistics.fmean(len(b) for b in bodies),
        "scoring_s": scoring,
    }


def _work(n: int) -> None:
    x = 0
    for _ in range(n):
        for k in range(200):
            x += k


def _calibrate() -> float:
    """Seconds of one unit of :func:`_work` on this thread."""
    t0 = time.perf_counter()
    _work(500)
    return (time.perf_counter() - t0) / 500


if __name__ == "__main__":
    print(json.dumps(_child(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))), flush=True)
    os._exit(0)  # the scoring process dies with this one
