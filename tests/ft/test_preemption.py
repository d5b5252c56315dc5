"""Preemption agreement on two real gloo ranks: a signal on one rank stops both at the same step boundary, carried in
the step's one agreement (no store poll, no collective of its own).

The ranks run a lockstep loop (one all-reduce per step, as data-parallel training does) under a step driver: the
round is issued at each step's start and taken at its end. A signal that arrives during step ``k`` is contributed at
the start of step ``k + 1`` and stops every rank at its end.
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

from lightning_resilience.collective import SideGroup
from lightning_resilience.ft.preemption import PreemptionNotice
from lightning_resilience.policy import Action, Decision, Event
from lightning_resilience.step.agreement import TreeAgreement
from lightning_resilience.step.driver import StepDriver
from tests._ranks import run_ranks

pytestmark = pytest.mark.timeout(90)

WORLD = 2
STEPS = 10


class _Stop:
    """The actor: records the stop (a Lightning suite would save and set ``should_stop``)."""

    def __init__(self) -> None:
        self.stopped: Decision | None = None

    def rollback(self, decision: Decision) -> Decision | None:
        raise AssertionError("no rollback expected")

    def stop(self, decision: Decision) -> None:
        self.stopped = decision

    def note(self, decision: Decision) -> None:
        pass


def _scenario(rank: int, world: int, tmp: Path, scenario: str) -> dict[str, Any]:
    notice = PreemptionNotice([signal.SIGUSR1], rank=rank)
    driver = StepDriver(agreement=TreeAgreement(SideGroup("step", timedelta(seconds=30))))
    driver.add_contributor(notice)
    actor = _Stop()
    signal_at = {"one_rank": {1: 3}, "both_ranks": {0: 2, 1: 3}, "none": {}}[scenario]
    notice.install()
    stopped = None
    try:
        for step in range(STEPS):
            driver.begin_step(step)
            t = torch.ones(1)
            dist.all_reduce(t)  # the lockstep of data-parallel training
            if signal_at.get(rank) == step:
                os.kill(os.getpid(), signal.SIGUSR1)  # a real signal: the handler runs before the next bytecode
            driver.end_step(step + 1, actor)
            if actor.stopped is not None:
                stopped = actor.stopped.step
                break
    finally:
        notice.uninstall()
        driver.close()
    return {
        "stopped": stopped,
        "event": actor.stopped.event.value if actor.stopped else None,
        "action": actor.stopped.action.value if actor.stopped else None,
        "stop_step": notice.stop_step,
        "received": notice.received,
        "handler_restored": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
    }


def _spawn(scenario: str, tmp: Path) -> list[dict[str, Any]]:
    return run_ranks(_scenario, WORLD, tmp, scenario, deadline_s=60, tcp_store=True)


def test_signal_on_one_rank_stops_both_at_the_next_boundary(tmp_path: Path) -> None:
    r0, r1 = _spawn("one_rank", tmp_path)
    # rank 1 got SIGUSR1 during step 3: contributed at the start of step 4, both stop at its end (boundary 5)
    assert r0["stopped"] == r1["stopped"] == 5
    assert r0["event"] == r1["event"] == Event.PREEMPTION.value
    assert r0["action"] == Action.EMERGENCY_SAVE_AND_EXIT.value
    assert (r0["received"], r1["received"]) == (False, True)
    assert r0["handler_restored"] and r1["handler_restored"]


def test_signals_on_both_ranks_stop_at_the_first(tmp_path: Path) -> None:
    r0, r1 = _spawn("both_ranks", tmp_path)
    assert r0["stopped"] == r1["stopped"] == 4  # rank 0's notice during step 2 stops both at boundary 4
    assert r0["stop_step"] == r1["stop_step"] == 3


def test_no_signal_never_stops(tmp_path: Path) -> None:
    r0, r1 = _spawn("none", tmp_path)
    assert r0["stopped"] is None and r1["stopped"] is None


def test_single_process_stops_at_the_end_of_the_next_step() -> None:
    notice = PreemptionNotice([signal.SIGUSR1])
    assert notice.agreed(5, notice.contribute(5)) == []
    notice.notify(signal.SIGUSR1)
    (verdict,) = notice.agreed(6, notice.contribute(6))
    assert verdict.event is Event.PREEMPTION and notice.stop_step == 6 and notice.received_signal == signal.SIGUSR1
    assert notice.agreed(7, notice.contribute(7)) == []  # the first agreement holds
