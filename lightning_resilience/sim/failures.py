"""Failure arrivals of a simulated job: one renewal process per node, drawn up front and merged in time order."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_resilience.sim.config import FAILURE_KINDS, SimConfig

__all__ = ["FailureTrace", "draw_failures"]


@dataclass(frozen=True)
class FailureTrace:
    """Failure arrivals in time order: seconds since the job started, kind name, node index."""

    times: np.ndarray
    kinds: tuple[str, ...]
    nodes: np.ndarray

    def __post_init__(self) -> None:
        if not (len(self.times) == len(self.kinds) == len(self.nodes)):
            raise ValueError("failure trace: times, kinds and nodes must have the same length")
        if len(self.times) and np.any(np.diff(self.times) < 0):
            raise ValueError("failure trace: times must be sorted ascending")
        unknown = sorted(set(self.kinds) - set(FAILURE_KINDS))
        if unknown:
            raise ValueError(f"failure trace: unknown failure kinds {unknown}; expected {FAILURE_KINDS}")

    @classmethod
    def of(cls, events: Sequence[tuple[float, str] | tuple[float, str, int]]) -> FailureTrace:
        """A trace from ``(time, kind)`` or ``(time, kind, node)`` tuples (node 0 when omitted)."""
        ordered = sorted(events, key=lambda e: e[0])
        return cls(
            times=np.array([float(e[0]) for e in ordered], dtype=float),
            kinds=tuple(str(e[1]) for e in ordered),
            nodes=np.array([int(e[2]) if len(e) > 2 else 0 for e in ordered], dtype=np.int64),  # type: ignore[misc]
        )

    def __len__(self) -> int:
        return len(self.times)


def draw_failures(cfg: SimConfig, rng: np.random.Generator, horizon_s: float | None = None) -> FailureTrace:
    """Draw every failure of the job up to the horizon: a renewal process per node, merged in time order.

    Each node's times between failures are exponential (``weibull_shape == 1``) or Weibull with that shape, with
    mean ``node MTTF = mttf_s * ref_gpus / gpus_per_node``; all nodes start fresh at time 0 and a failed node is
    renewed (repaired or replaced). Kinds are drawn independently with the configured fractions.
    """
    horizon = cfg.job.horizon_s if horizon_s is None else horizon_s
    nodes = cfg.cluster.nodes
    mean = cfg.failures.node_mttf_s(cfg.cluster.gpus_per_node)
    shape = cfg.failures.weibull_shape
    scale = mean / math.gamma(1.0 + 1.0 / shape)
    block = max(4, int(2 * horizon / mean) + 4)
    last = np.zeros(nodes)
    times: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    active = np.arange(nodes)
    while active.size:
        if shape == 1.0:
            gaps = rng.exponential(mean, size=(active.size, block))
        else:
            gaps = scale * rng.weibull(shape, size=(active.size, block))
        arrivals = last[active, None] + np.cumsum(gaps, axis=1)
        inside = arrivals <= horizon
        times.append(arrivals[inside])
        ids.append(np.broadcast_to(active[:, None], arrivals.shape)[inside])
        last[active] = arrivals[:, -1]
        active = active[last[active] <= horizon]
    all_times = np.concatenate(times) if times else np.empty(0)
    all_nodes = np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)
    order = np.argsort(all_times, kind="stable")
    fractions = np.array([k.fraction for k in cfg.failures.kinds], dtype=float)
    picks = rng.choice(len(fractions), size=len(order), p=fractions / fractions.sum())
    names = [k.name for k in cfg.failures.kinds]
    return FailureTrace(
        times=all_times[order], kinds=tuple(names[p] for p in picks), nodes=all_nodes[order].astype(np.int64)
    )
