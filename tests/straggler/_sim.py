"""In-process multi-rank harness: N real detectors, each with its own fake clock, exchanging payloads in lockstep.

``prepare`` on every rank, then ``consume`` of the same payload list on every rank: exactly what ``end_step`` does
with a real all-gather, without processes or sleeps. Steps are synchronous as under DDP: after its data wait and
its compute, every rank waits in a collective (the ``wait`` section) until the slowest rank arrives, so every rank's
step period is the same and only ``compute`` and ``data`` tell the ranks apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from lightning_resilience.straggler import WAIT, Escalation, StragglerDetector, StragglerFinding
from lightning_resilience.straggler.config import StragglerConfig


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


CostFn = Callable[[int, int], float]
"""(rank, step) -> seconds of compute that step takes on that rank."""


def jitter_cost(
    seed: int,
    *,
    base: float = 0.1,
    sigma: float = 0.03,
    common_sigma: float = 0.05,
    slow_rank: int | None = None,
    factor: float = 1.0,
    onset: int = 0,
    spikes: dict[tuple[int, int], float] | None = None,
) -> CostFn:
    """Lognormal per-rank jitter around a common lognormal step time; ``slow_rank`` is ``factor`` x slower from
    ``onset``; ``spikes`` maps (rank, step) to a one-off multiplier."""
    rng = np.random.default_rng(seed)
    common: dict[int, float] = {}
    own: dict[tuple[int, int], float] = {}

    def cost(rank: int, step: int) -> float:
        if step not in common:
            common[step] = base * float(np.exp(rng.normal(0.0, common_sigma)))
        if (rank, step) not in own:
            own[(rank, step)] = float(np.exp(rng.normal(0.0, sigma)))
        c = common[step] * own[(rank, step)]
        if rank == slow_rank and step >= onset:
            c *= factor
        if spikes and (rank, step) in spikes:
            c *= spikes[(rank, step)]
        return c

    return cost


class Cluster:
    """``world`` detectors on fake clocks; ``run`` drives them step by step."""

    def __init__(
        self,
        world: int,
        config: StragglerConfig | None = None,
        *,
        ranks_per_node: int = 2,
        gather_every: int = 1,
        **kwargs: Any,
    ) -> None:
        # every step is exchanged unless a test asks for a cadence: the scoring is the same, only later
        config = dataclasses.replace(config or StragglerConfig(), gather_every_n_steps=gather_every)
        self.clocks = [FakeClock() for _ in range(world)]
        self.detectors = [
            StragglerDetector(
                config,
                rank=r,
                world_size=world,
                gather=lambda p: [p],  # never called: the harness gathers
                clock=self.clocks[r],
                hostname=f"node{r // ranks_per_node}",
                local_world_size=ranks_per_node,
                **kwargs,
            )
            for r in range(world)
        ]
        self.decisions: list[list[tuple[int, Escalation]]] = [[] for _ in range(world)]
        self.step = 0

    def run(self, steps: int, cost: CostFn, *, section: str | None = None, data: CostFn | None = None) -> None:
        """``steps`` synchronous training steps; ``cost`` is each rank's compute (spent inside ``section`` if given),
        ``data`` its wait for the batch (default 1 ms); then a collective waits for the slowest rank."""
        for _ in range(steps):
            payloads = []
            data_s = [data(r, self.step) if data is not None else 0.001 for r in range(len(self.detectors))]
            own = [cost(r, self.step) for r in range(len(self.detectors))]
            arrival = max(d + c for d, c in zip(data_s, own))
            for r, (det, clock) in enumerate(zip(self.detectors, self.clocks)):
                clock.advance(data_s[r])
                det.start_step()
                if section is not None:
                    with det.section(section):
                        clock.advance(own[r])
                else:
                    clock.advance(own[r])
                with det.section(WAIT):  # the gradient all-reduce: done when the slowest rank arrives
                    clock.advance(arrival - data_s[r] - own[r] + 0.002)
                det.timer.end_step()
                payloads.append(det.prepare(self.step))
            if payloads[0] is not None:
                assert all(p is not None for p in payloads), "ranks disagree on the gather step"
                for r, det in enumerate(self.detectors):
                    self.decisions[r] += [(self.step, d) for d in det.consume(self.step, payloads)]
            for det in self.detectors:
                det.timer.mark_idle()
            self.step += 1

    @property
    def verdicts(self) -> list[StragglerFinding]:
        return self.detectors[0].verdicts
