"""Preemption agreement on two real gloo ranks: a signal on one rank stops both at the same step boundary.

The ranks run a lockstep loop (one all-reduce per step, as data-parallel training does) and check the notice at every
boundary through the c10d store, with no extra collective. Orderings that a real run only hits by chance are forced
through the store: the signalled rank publishes only after its peer already passed the same boundary.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_resilience.ft.preemption import PreemptionNotice, connect_store
from tests._ranks import run_ranks

pytestmark = pytest.mark.timeout(90)

WORLD = 2
STEPS = 10
PG_TIMEOUT = timedelta(seconds=60)
STORE_TIMEOUT = timedelta(seconds=30)
SPAWN_DEADLINE_S = 60.0


def _loop(rank: int, notice: PreemptionNotice, signal_at: dict[int, int], sync: dist.Store) -> dict[str, Any]:
    checks: list[bool] = []
    stopped = None
    for step in range(1, STEPS + 1):
        t = torch.ones(1)
        dist.all_reduce(t)  # the lockstep of data-parallel training
        if signal_at.get(rank) == step:
            if rank == 1:  # force the worst case: the peer has already checked this boundary
                sync.wait([f"checked/{step}"], STORE_TIMEOUT)
            os.kill(os.getpid(), signal.SIGUSR1)  # a real signal: the handler runs before the next bytecode
        stop = notice.should_stop(step)
        checks.append(stop)
        if rank == 0:
            sync.set(f"checked/{step}", "1")
        if stop:
            stopped = step
            break
    return {"stopped": stopped, "checks": checks, "published": notice.published, "received": notice.received}


def _scenario(rank: int, world: int, tmp: Path, scenario: str) -> dict[str, Any]:
    store, why = connect_store(STORE_TIMEOUT, f"test/{scenario}")
    assert store is not None and "TCPStore client" in why, why
    notice = PreemptionNotice([signal.SIGUSR1], store)
    notice.install()
    try:
        signal_at = {"one_rank": {1: 3}, "both_ranks": {0: 2, 1: 3}, "none": {}}[scenario]
        sync = dist.PrefixStore("sync/", store)
        result = _loop(rank, notice, signal_at, sync)
    finally:
        notice.uninstall()
    result["handler_restored"] = signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    return result


def _spawn(scenario: str, tmp: Path) -> list[dict[str, Any]]:
    return run_ranks(
        _scenario, WORLD, tmp, scenario, deadline_s=SPAWN_DEADLINE_S, pg_timeout=PG_TIMEOUT, tcp_store=True
    )


def test_signal_on_one_rank_stops_both_at_the_next_boundary(tmp_path: Path) -> None:
    r0, r1 = _spawn("one_rank", tmp_path)
    # rank 1 got SIGUSR1 at boundary 3, after rank 0 had passed it: both stop at boundary 4
    assert r0["stopped"] == r1["stopped"] == 4
    assert r0["checks"] == [False, False, False, True] and r1["checks"] == [False, False, False, True]
    assert (r0["received"], r0["published"], r1["received"], r1["published"]) == (False, False, True, True)
    assert r0["handler_restored"] and r1["handler_restored"]


def test_signals_on_both_ranks_first_publication_wins(tmp_path: Path) -> None:
    r0, r1 = _spawn("both_ranks", tmp_path)
    assert r0["stopped"] == r1["stopped"] == 3  # rank 0's notice at boundary 2 wins; rank 1's adopts it
    assert r0["published"] and r1["received"]  # rank 1 had already adopted the stop step when its own came


def test_no_signal_never_stops(tmp_path: Path) -> None:
    r0, r1 = _spawn("none", tmp_path)
    assert r0["stopped"] is None and r1["stopped"] is None
    assert r0["checks"] == [False] * STEPS


def test_single_process_stops_at_the_current_boundary() -> None:
    notice = PreemptionNotice([signal.SIGUSR1], None)
    assert not notice.should_stop(5)
    notice.notify(signal.SIGUSR1)
    assert notice.should_stop(6) and notice.stop_step == 6 and notice.received_signal == signal.SIGUSR1
