"""StragglerDetector on real gloo ranks: the slow rank (slowed through its fake clock from a random onset) is named
within a bounded number of steps, clean and spiky runs give no verdict, and a stop decision reaches every rank at the
same step. Each rank writes its result to a JSON file; the parent asserts on all of them. Every wait is bounded.
"""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from lightning_resilience.straggler import StragglerDetector
from lightning_resilience.straggler.config import StragglerConfig, StragglerLevelConfig
from tests._ranks import run_ranks
from tests.straggler._sim import FakeClock, jitter_cost

pytestmark = pytest.mark.timeout(120)

WORLD = 3
STEPS = 160
PG_TIMEOUT = timedelta(seconds=60)
SPAWN_DEADLINE_S = 90.0
MAX_LATENCY = 5  # slow steps observed before the verdict, at 1.2x


# ----------------------------------------------------------------------------------------------- in the children
def _run(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    levels = [
        StragglerLevelConfig(action="log", slowdown=1.1, persist_steps=1),
        StragglerLevelConfig(action="stop", slowdown=1.15, persist_steps=4),
    ]
    clock = FakeClock()
    detector = StragglerDetector.from_process_group(
        StragglerConfig(levels=levels, gather_timeout_s=60), clock=clock, local_world_size=1
    )
    spikes = {tuple(s[:2]): s[2] for s in spec.get("spikes", [])}
    # one shared seed: every rank draws the same common-mode jitter; its own part comes from its rank's draws
    cost = jitter_cost(spec["seed"], slow_rank=spec.get("slow"), factor=spec.get("factor", 1.0),
                       onset=spec.get("onset", 0), spikes=spikes)  # fmt: skip
    stopped_at = None
    try:
        for step in range(STEPS):
            detector.start_step()
            with detector.section("forward"):
                clock.advance(cost(rank, step))
            detector.end_step(step)
            if detector.should_stop:
                stopped_at = step
                break
        return {
            "world": detector.world_size,
            "mode": detector.mode,
            "verdicts": [v.to_dict() for v in detector.verdicts],
            "decisions": [d.to_dict() for d in detector.decisions],
            "stopped_at": stopped_at,
            "gathers": detector.gathers,
            "nodes": detector.nodes,
        }
    finally:
        detector.close()


def _ranked(rank: int, world: int, tmp: Path, spec: dict[str, Any]) -> dict[str, Any]:
    return _run(rank, spec)


def _spawn(spec: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
    return run_ranks(_ranked, WORLD, tmp, spec, deadline_s=SPAWN_DEADLINE_S, pg_timeout=PG_TIMEOUT)


def test_slow_rank_named_within_bound_and_stop_reaches_every_rank(tmp_path: Path) -> None:
    rnd = random.Random(1234)
    onset, slow = rnd.randint(30, 90), rnd.randrange(WORLD)
    results = _spawn({"seed": 17, "slow": slow, "factor": 1.2, "onset": onset}, tmp_path)
    first = results[0]
    assert first["world"] == WORLD and first["mode"] == "relative" and len(first["nodes"]) == WORLD
    verdict = first["verdicts"][0]
    assert verdict["rank"] == slow and verdict["section"] == "compute"
    assert verdict["node_index"] == slow  # LOCAL_WORLD_SIZE=1: one rank per node
    assert onset <= verdict["step"] <= onset + MAX_LATENCY - 1, (onset, verdict)
    assert all(v["rank"] == slow for v in first["verdicts"])
    # one collective decision: identical on every rank, and every rank stopped at the same exchange (each exchange
    # carries the timings of every step since the previous one: the decision is reported at most a cadence later)
    assert all(r["decisions"] == first["decisions"] for r in results)
    assert first["decisions"][-1]["action"] == "checkpoint_and_stop"
    (stopped_at,) = {r["stopped_at"] for r in results}
    cadence = StragglerConfig().gather_every_n_steps
    assert first["decisions"][-1]["step"] <= stopped_at < first["decisions"][-1]["step"] + cadence


def test_clean_and_spiky_runs_have_no_verdict(tmp_path: Path) -> None:
    spikes = [[0, 40, 4.0], [1, 70, 2.5], [2, 71, 3.0], [1, 120, 6.0]]
    results = _spawn({"seed": 5, "spikes": spikes}, tmp_path)
    for r in results:
        assert r["verdicts"] == [] and r["decisions"] == [] and r["stopped_at"] is None
        config = StragglerConfig()
        assert r["gathers"] == (STEPS - config.warmup_steps) // config.gather_every_n_steps
