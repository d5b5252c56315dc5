"""Discrete-event simulation of a training job under failures: where the wall-clock time goes, and the ETTR.

The job trains at a fixed step time. Each checkpoint tier blocks the loop for ``blocking_s`` at its cadence and
commits ``write_s`` later. Failures arrive from one renewal process per node (exponential or Weibull times between
failures) and are all drawn up front with NumPy; the event loop then walks them in time order. Between two events
progress is computed in closed form (a binary search over the step index), so the cost of a simulation grows with
the number of failures, not with the number of steps: a 90-day job on 10,000 accelerators takes well under a second.

Per failure, by kind:

* ``crash`` - the job stops at the fault; ``detection_s`` later the restart begins.
* ``hang`` - the job stalls at the fault (writes already in flight may still commit); ``detection_s`` later the
  restart begins.
* ``sdc`` - the job keeps training on corrupted state until detection; everything after the fault is lost, including
  checkpoints taken meanwhile.
* ``fail_slow`` - steps take ``1 + slowdown`` times longer until detection; then the slow node is restarted away.

A lost node (``node_lost``) needs a warm spare (if one is left) or a cold restart, and takes with it every tier of
durability ``process`` or ``host``; a ``peer`` tier survives unless two neighbouring nodes (ring placement) are lost
within one recovery. A surviving node restarts by the kind's ``restart`` path: ``in_process`` keeps every tier,
``in_job`` and ``cold`` lose the ``process`` tier. The job restores from the newest committed checkpoint left in any
tier (the cheapest restore on a tie), or from step 0. A crash or hang during a recovery restarts the recovery; an SDC
or fail-slow during one takes effect when training resumes. A failure that lands while an SDC or fail-slow is still
undetected also ends that one (the restart clears it; checkpoints after an SDC are still discarded).
"""

from __future__ import annotations

import math
import time

import numpy as np

from lightning_resilience.sim.config import (
    FAILURE_KINDS,
    RESTART_PATHS,
    FailureKindConfig,
    SimConfig,
)
from lightning_resilience.sim.failures import FailureTrace, draw_failures
from lightning_resilience.sim.results import CATEGORIES, Breakdown, MonteCarloResult, SimResult

__all__ = [
    "CATEGORIES",
    "Breakdown",
    "FailureTrace",
    "MonteCarloResult",
    "SimResult",
    "draw_failures",
    "simulate",
    "simulate_many",
]

_SURVIVES = {  # loss scope -> durabilities that keep their copy
    "none": frozenset({"process", "host", "peer", "remote"}),
    "process": frozenset({"host", "peer", "remote"}),
    "node": frozenset({"peer", "remote"}),
}


class _Tier:
    """Run-time state of one checkpoint tier."""

    __slots__ = ("b", "durability", "held", "inflight", "k", "keep", "name", "r", "w")

    def __init__(self, name: str, k: int, b: float, w: float, r: float, durability: str, keep: int) -> None:
        self.name, self.k, self.b, self.w, self.r, self.durability, self.keep = name, k, b, w, r, durability, keep
        self.held: list[int] = []
        self.inflight: tuple[int, float] | None = None


class _Engine:
    def __init__(self, cfg: SimConfig, trace: FailureTrace) -> None:
        self.cfg = cfg
        self.step_s = cfg.job.step_s
        self.suite_s = cfg.suite.per_step_s(cfg.cluster.gpus, self.step_s)
        self.tau = self.step_s + self.suite_s  # every step pays the suite's step path
        self.horizon = cfg.job.horizon_s
        self.target = cfg.job.target_steps
        self.nodes = cfg.cluster.nodes
        self.tiers: list[_Tier] = []
        for t, cadence in zip(cfg.tiers, cfg.cadences()):
            k = cadence.every_n_steps
            if t.write_s > k * self.tau:  # a write still in flight defers the next checkpoint of the tier
                k *= math.ceil(t.write_s / (k * self.tau))
            self.tiers.append(_Tier(t.name, k, t.blocking_s, t.write_s, t.restore_s, t.durability, t.keep))
        self.kinds: dict[str, FailureKindConfig] = {k.name: k for k in cfg.failures.kinds}
        self.times = trace.times.tolist()
        self.kind_of = list(trace.kinds)
        self.node_of = trace.nodes.tolist()
        self.i = 0
        self.deferred: list[tuple[str, int]] = []
        self.bd = Breakdown()
        self.steps_computed = 0
        self.partial = 0.0
        self.spares = cfg.cluster.spare_nodes
        self.refills: list[float] = []
        self.window_nodes: set[int] = set()
        self.failures = dict.fromkeys(FAILURE_KINDS, 0)
        self.restarts = dict.fromkeys(RESTART_PATHS, 0)
        self.restores: dict[str, int] = {t.name: 0 for t in self.tiers} | {"scratch": 0}

    # ---- training between events ------------------------------------------------------------------------------

    def _blocked(self, s0: int, x: int) -> float:
        """Blocking seconds of the checkpoints at steps in (s0, x]."""
        return sum(t.b * (x // t.k - s0 // t.k) for t in self.tiers) if x > s0 else 0.0

    def _block_at(self, s: int) -> float:
        return sum(t.b for t in self.tiers if s % t.k == 0)

    def _train(self, t0: float, s0: int, t_end: float, tau: float) -> tuple[int, float, bool]:
        """Train from step ``s0`` at ``t0`` until ``t_end`` (or the target step); books the time.

        Returns the step reached, the time training stopped, and whether the target step was reached.
        """

        def reached(s: int) -> float:  # time step s completes (its checkpoint block not included)
            return t0 + (s - s0) * tau + self._blocked(s0, s - 1) if s > s0 else t0

        lo, hi = s0, s0 + int((t_end - t0) / tau) + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if reached(mid) <= t_end:
                lo = mid
            else:
                hi = mid
        s = lo
        finished = False
        if self.target is not None and s >= self.target:
            s, finished = max(self.target, s0), True
            t_end = reached(s)
        ts = reached(s)
        blk = self._block_at(s) if s > s0 else 0.0
        if finished:
            blocking, partial, s_ck = self._blocked(s0, s - 1), 0.0, s - 1
        elif ts + blk <= t_end:
            blocking, partial, s_ck = self._blocked(s0, s), t_end - ts - blk, s
        else:
            blocking, partial, s_ck = self._blocked(s0, s - 1) + (t_end - ts), 0.0, s - 1
        self.bd.checkpoint += blocking
        self.partial += partial
        self.steps_computed += s - s0
        self.bd.degraded += (s - s0) * (tau - self.tau)
        for tier in self.tiers:
            c_last = (s_ck // tier.k) * tier.k
            if tier.inflight is not None and tier.inflight[1] <= t_end:
                tier.held.append(tier.inflight[0])
                tier.inflight = None
            if c_last <= s0:
                continue
            commit = reached(c_last) + self._block_at(c_last) + tier.w
            newest = c_last
            if commit > t_end:
                tier.inflight = (c_last, commit)
                newest = c_last - tier.k
            first = max(newest - (tier.keep - 1) * tier.k, (s0 // tier.k + 1) * tier.k)
            if newest >= first:
                tier.held.extend(range(first, newest + 1, tier.k))
                del tier.held[: -tier.keep]
        return s, t_end, finished

    # ---- events ---------------------------------------------------------------------------------------------

    def _peek(self, now: float) -> tuple[float, str, int] | None:
        if self.deferred:
            kind, node = self.deferred[0]
            return now, kind, node
        if self.i < len(self.times):
            return self.times[self.i], self.kind_of[self.i], self.node_of[self.i]
        return None

    def _pop(self) -> None:
        if self.deferred:
            self.deferred.pop(0)
        else:
            self.i += 1

    def _next_interrupt(self, until: float) -> tuple[float, str, int] | None:
        """The first crash or hang in the trace before ``until``; SDC and fail-slow arrivals meanwhile are deferred."""
        while self.i < len(self.times) and self.times[self.i] < until:
            kind = self.kind_of[self.i]
            if kind in ("crash", "hang"):
                return self.times[self.i], kind, self.node_of[self.i]
            self.deferred.append((kind, self.node_of[self.i]))
            self.i += 1
        return None

    def _lose(self, kind: FailureKindConfig, node: int, now: float) -> tuple[str, str]:
        """Drop what the failure destroys; returns (restart path, loss scope)."""
        if kind.node_lost:
            while self.refills and self.refills[0] <= now:
                self.refills.pop(0)
                self.spares += 1
            if self.spares > 0:
                self.spares -= 1
                self.refills.append(now + self.cfg.cluster.spare_refill_s)
                self.refills.sort()
                path = "warm_spare"
            else:
                path = "cold"
            scope = "node"
            neighbours = {(node - 1) % self.nodes, (node + 1) % self.nodes} - {node}
            peer_lost = bool(neighbours & self.window_nodes)
            self.window_nodes.add(node)
        else:
            path = kind.restart
            scope = "none" if path == "in_process" else "process"
            peer_lost = False
        keep = _SURVIVES[scope]
        for tier in self.tiers:
            tier.inflight = None
            if tier.durability not in keep or (peer_lost and tier.durability == "peer"):
                tier.held.clear()
        return path, scope

    def _choose_restore(self) -> tuple[int, _Tier | None]:
        best: _Tier | None = None
        for tier in self.tiers:
            if tier.held and (
                best is None or tier.held[-1] > best.held[-1] or (tier.held[-1] == best.held[-1] and tier.r < best.r)
            ):
                best = tier
        return (best.held[-1], best) if best is not None else (0, None)

    def _recover(self, now: float, kind: FailureKindConfig, node: int, detection: float) -> tuple[float | None, int]:
        """Detection, restart, restore; starts over on a crash or hang meanwhile.

        Returns the time training resumes (None when the horizon ends the recovery) and the step it resumes from.
        """
        while True:
            self.failures[kind.name] += 1
            path, _scope = self._lose(kind, node, now)
            restart = self.cfg.restart.seconds(path)
            step, tier = self._choose_restore()
            restore = tier.r if tier is not None else 0.0
            phases = (("detection", detection), ("restart", restart), ("restore", restore))
            end = now + detection + restart + restore
            interrupt = self._next_interrupt(min(end, self.horizon))
            stop = interrupt[0] if interrupt is not None else min(end, self.horizon)
            self.restarts[path] += 1
            t = now
            for name, length in phases:
                spent = max(0.0, min(length, stop - t))
                setattr(self.bd, name, getattr(self.bd, name) + spent)
                t += length
            if interrupt is not None:
                now, kind_name, node = interrupt
                self.i += 1
                kind = self.kinds[kind_name]
                detection = kind.detection_s
                continue
            if end >= self.horizon:
                return None, step
            self.restores[tier.name if tier is not None else "scratch"] += 1
            self.window_nodes.clear()
            return end, step

    def run(self) -> tuple[float, int]:
        t, s = 0.0, 0
        while True:
            ev = self._peek(t)
            if ev is None or ev[0] >= self.horizon:
                s, t, _ = self._train(t, s, self.horizon, self.tau)
                return t, s
            te, kind_name, node = ev
            kind = self.kinds[kind_name]
            s, t_stop, finished = self._train(t, s, te, self.tau)
            if finished:
                return t_stop, s
            self._pop()
            t = te
            detection = kind.detection_s
            if kind.name in ("sdc", "fail_slow"):
                clean = s
                t_det = min(te + kind.detection_s, self.horizon)
                interrupt = self._next_interrupt(t_det)
                t_end = interrupt[0] if interrupt is not None else t_det
                tau = self.tau * (1.0 + kind.slowdown)
                s, t_stop, finished = self._train(te, s, t_end, tau)
                if finished:
                    return t_stop, s
                if t_end >= self.horizon:
                    return t_end, s
                if kind.name == "sdc":
                    # everything after the fault is corrupt: its steps are lost and its checkpoints unusable
                    for tier in self.tiers:
                        tier.held = [c for c in tier.held if c <= clean]
                        if tier.inflight is not None and tier.inflight[0] > clean:
                            tier.inflight = None
                t = t_end
                detection = 0.0
                if interrupt is not None:  # the crash or hang ends the window: handle it with the damage so far
                    self.failures[kind.name] += 1
                    self.i += 1
                    kind, node = self.kinds[interrupt[1]], interrupt[2]
                    detection = kind.detection_s
            else:
                if kind.name == "hang":  # stalled, not dead: writes in flight may still commit before detection
                    for tier in self.tiers:
                        if tier.inflight is not None and tier.inflight[1] <= te + kind.detection_s:
                            tier.held.append(tier.inflight[0])
                            del tier.held[: -tier.keep]
            resumed, s = self._recover(t, kind, node, detection)
            if resumed is None:
                return self.horizon, s
            t = resumed

    def result(self, wall: float, final_step: int, seed: int | None, elapsed: float) -> SimResult:
        self.bd.productive = final_step * self.step_s
        self.bd.suite = final_step * self.suite_s
        self.bd.lost = (self.steps_computed - final_step) * self.tau + self.partial
        return SimResult(
            wall_s=wall,
            breakdown=self.bd,
            final_step=final_step,
            failures={k: v for k, v in self.failures.items() if k in self.kinds},
            restarts=dict(self.restarts),
            restores=dict(self.restores),
            job_mttf_s=self.cfg.failures.job_mttf_s(self.cfg.cluster.gpus),
            seed=seed,
            sim_seconds=elapsed,
        )


def simulate(cfg: SimConfig, *, seed: int | None = None, trace: FailureTrace | None = None) -> SimResult:
    """Simulate one job.

    Args:
        cfg: the cluster, failures, tiers, restart costs and job.
        seed: seed of the failure draws (default ``cfg.job.seed``); ignored when ``trace`` is given.
        trace: replay these failures instead of drawing them (kinds must be configured in ``cfg.failures.kinds``).

    Returns:
        The ETTR, the time breakdown and the counts of failures, restarts and restores.
    """
    started = time.perf_counter()
    if trace is None:
        seed = cfg.job.seed if seed is None else seed
        trace = draw_failures(cfg, np.random.default_rng(seed))
    else:
        seed = None
        missing = sorted(set(trace.kinds) - {k.name for k in cfg.failures.kinds})
        if missing:
            raise ValueError(f"failure trace has kinds {missing} that failures.kinds does not configure")
    engine = _Engine(cfg, trace)
    wall, final_step = engine.run()
    return engine.result(wall, final_step, seed, time.perf_counter() - started)


def simulate_many(cfg: SimConfig, replications: int = 10) -> MonteCarloResult:
    """``replications`` independent runs with seeds ``cfg.job.seed + r``."""
    if replications < 1:
        raise ValueError(f"replications must be >= 1, got {replications}")
    return MonteCarloResult([simulate(cfg, seed=cfg.job.seed + r) for r in range(replications)])
