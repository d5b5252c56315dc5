"""The synthetic cross-check of ``benchmarks.straggler_detection`` (at scale, not a measurement): simulated ranks
feed the real detector through fake clocks; every step, every rank waits in a modelled collective until the slowest
arrives, so whole-step times are equal across ranks as under DDP and only compute and data tell them apart."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lightning_resilience.straggler import WAIT, StragglerDetector, StragglerFinding
from lightning_resilience.straggler.config import StragglerConfig

__all__ = ["SYNTH_FACTORS", "NoiseModel", "synthetic", "synthetic_trial"]

SYNTH_FACTORS = (1.1, 1.2, 1.5, 2.0)

pc = time.perf_counter


@dataclass(frozen=True)
class NoiseModel:
    """Synthetic step-time model (fake seconds): compute, data wait, and the collective that equalises the step."""

    compute_s: float = 1.0
    data_s: float = 0.02
    common_sigma: float = 0.05
    """Lognormal sigma of the compute jitter every rank shares at a step (batch content)."""
    rank_sigma: float = 0.03
    """Lognormal sigma of each rank's own compute jitter."""
    data_sigma: float = 0.5
    """Lognormal sigma of each rank's data wait."""
    rank_spike_p: float = 0.005
    job_spike_p: float = 0.01
    spike_low: float = 1.5
    spike_high: float = 3.0
    comm_s: float = 0.05
    """Time of the collective itself once the slowest rank has arrived."""


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def synthetic_trial(
    rng: np.random.Generator,
    cfg: StragglerConfig,
    noise: NoiseModel,
    world: int,
    steps: int,
    slow: tuple[int, str, float, int] | None,
) -> list[StragglerFinding]:
    """One simulated synchronous job through real detectors; ``slow`` = (rank, kind, factor, onset)."""
    clocks = [_Clock() for _ in range(world)]
    detectors = [
        StragglerDetector(cfg, rank=r, world_size=world, gather=lambda p: [p], clock=clocks[r], hostname=f"n{r // 8}")
        for r in range(world)
    ]
    compute = noise.compute_s * np.exp(rng.normal(0.0, noise.common_sigma, steps))[:, None]
    compute = compute * np.exp(rng.normal(0.0, noise.rank_sigma, (steps, world)))
    spike = rng.random((steps, world)) < noise.rank_spike_p
    compute[spike] *= rng.uniform(noise.spike_low, noise.spike_high, int(spike.sum()))
    job_spike = rng.random(steps) < noise.job_spike_p
    compute[job_spike] *= rng.uniform(noise.spike_low, noise.spike_high, int(job_spike.sum()))[:, None]
    data = noise.data_s * np.exp(rng.normal(0.0, noise.data_sigma, (steps, world)))
    if slow is not None:
        rank, kind, factor, onset = slow
        extra = (factor - 1.0) * (noise.compute_s + noise.data_s)
        (compute if kind == "compute" else data)[onset:, rank] += extra
    arrival = (compute + data).max(axis=1)
    for step in range(steps):
        payloads = []
        for r in range(world):
            det, clock = detectors[r], clocks[r]
            clock.now += float(data[step, r])
            det.start_step()
            clock.now += float(compute[step, r])
            with det.section(WAIT):
                clock.now += float(arrival[step] - data[step, r] - compute[step, r]) + noise.comm_s
            det.timer.end_step()
            payloads.append(det.prepare(step))
        if payloads[0] is not None:
            detectors[0].consume(step, payloads)
        for det in detectors:
            det.timer.mark_idle()
    return detectors[0].verdicts


def synthetic(args: argparse.Namespace, kinds: Sequence[str]) -> dict[str, Any]:
    """Slow trials of each factor and kind, and clean trials, of ``args.synth_*`` sizes."""
    rng = np.random.default_rng(args.seed)
    cfg, noise = StragglerConfig(), NoiseModel()
    first_onset = cfg.warmup_steps + cfg.window // 2 + 16
    groups: dict[str, Any] = {}
    t0 = pc()
    for factor in SYNTH_FACTORS:
        for kind in kinds:
            latencies: list[int] = []
            false = 0
            for _ in range(args.synth_trials):
                rank, onset = int(rng.integers(args.synth_world)), int(rng.integers(first_onset, args.synth_steps - 60))
                verdicts = synthetic_trial(
                    rng, cfg, noise, args.synth_world, args.synth_steps, (rank, kind, factor, onset)
                )
                good = [v for v in verdicts if v.rank == rank and v.section == kind and v.step >= onset]
                false += len([v for v in verdicts if v.rank != rank or v.step < onset])
                if good:
                    latencies.append(good[0].step - onset + 1)
            n = args.synth_trials
            groups[f"{kind}@{factor}"] = {
                "factor": factor,
                "kind": kind,
                "trials": n,
                "recall": len(latencies) / n,
                "precision": len(latencies) / (len(latencies) + false) if latencies or false else None,
                "latency_median": statistics.median(latencies) if latencies else None,
                "latency_max": max(latencies) if latencies else None,
            }
    clean_verdicts = 0
    for _ in range(args.synth_clean_trials):
        clean_verdicts += len(synthetic_trial(rng, cfg, noise, args.synth_world, args.synth_clean_steps, None))
    clean_steps = args.synth_clean_trials * args.synth_clean_steps
    return {
        "world": args.synth_world,
        "noise": asdict(noise),
        "groups": groups,
        "clean": {"steps": clean_steps, "false_verdicts": clean_verdicts},
        "wall_s": pc() - t0,
    }
