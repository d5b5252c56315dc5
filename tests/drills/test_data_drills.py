"""The user's path under faults: a plain Lightning script (``DataLoader(shuffle=True)``, dropout, ``torch.randn``
noise, StepLR, DDP on 2 CPU ranks) with the default resilience preset, launched by torchrun, ends bitwise equal to
an uninterrupted run after every fault.

CI runs a bounded subset (a SIGKILL at a seeded random step with 2 loader workers, and a SIGTERM to the launcher
followed by a relaunch without workers). ``make drills-data`` runs them all (``LR_DRILLS=all``) plus ``DRILL_N``
random drills drawn from ``DRILL_SEED``; a failing drill prints its seed and the command to replay it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from tests.drills._harness import Drill, DrillResult, drill_seed, first_difference, random_drills, run_drill

pytestmark = pytest.mark.slow

SEED = drill_seed()
ALL = os.environ.get("LR_DRILLS") == "all"
nightly = pytest.mark.skipif(not ALL, reason="part of `make drills-data` (LR_DRILLS=all), not of CI")


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, torch.Tensor]]:
    """Final weights of the uninterrupted run, per loader worker count (computed on first use)."""
    cache: dict[int, dict[str, torch.Tensor]] = {}

    class _Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, workers: int) -> dict[str, torch.Tensor]:
            result = run_drill(Drill(workers=workers), tmp_path_factory.mktemp(f"reference_w{workers}"))
            assert all(r["restored_step"] is None for r in result.reports.values()), "the reference restored"
            self[workers] = result.weights()
            return self[workers]

    return _Lazy(cache)


def _check(result: DrillResult, reference: dict[str, torch.Tensor]) -> None:
    drill = result.drill
    replay = f"DRILL_SEED={SEED} (drill: {drill.describe()}; logs in {result.run_dir})"
    resumed = [r for r in result.reports.values() if r.get("restored_step") is not None]
    assert resumed, f"nothing resumed from a checkpoint: {result.reports} {replay}"
    # a SIGKILL loses the steps after the newest persist; a SIGTERM is agreed on and saved a step or two later
    last = drill.step if drill.fault.startswith("sigkill") else drill.steps - 1
    assert all(0 < r["restored_step"] <= last for r in resumed), f"{result.reports} {replay}"
    assert len(result.finished) == drill.world_size, f"{result.reports} {replay}"
    diff = first_difference(result.weights(), reference)
    assert diff is None, f"final weights differ from the uninterrupted run: {diff}; {replay}"
    print(f"drill ok: {drill.describe()}, resumed from step {resumed[0]['restored_step']}; {replay}")


def test_sigkill_at_a_random_step_with_workers(tmp_path: Path, references: dict) -> None:
    step = random.Random(SEED).randint(3, 37)
    drill = Drill(fault="sigkill", step=step, rank=1, workers=2)
    _check(run_drill(drill, tmp_path), references[2])


def test_sigterm_to_the_launcher_then_relaunch(tmp_path: Path, references: dict) -> None:
    step = random.Random(SEED + 1).randint(3, 30)
    drill = Drill(fault="sigterm-launcher", step=step, rank=0, workers=0)
    result = run_drill(drill, tmp_path)
    assert len(result.launches) == 2 and result.launches[0].returncode != 0, result.log()
    _check(result, references[0])


@nightly
@pytest.mark.parametrize("workers", [0, 2])
def test_sigkill_during_a_persist(tmp_path: Path, references: dict, workers: int) -> None:
    drill = Drill(fault="sigkill-persist", step=20, rank=0, workers=workers)
    result = run_drill(drill, tmp_path)
    _check(result, references[workers])
    assert all(r["restored_step"] < 20 for r in result.reports.values() if r.get("restored_step") is not None)


@nightly
@pytest.mark.parametrize("workers", [0, 2])
def test_sigterm_to_one_rank(tmp_path: Path, references: dict, workers: int) -> None:
    step = random.Random(SEED + 2 + workers).randint(3, 30)  # the stop is agreed on a step or two later
    _check(run_drill(Drill(fault="sigterm-rank", step=step, rank=1, workers=workers), tmp_path), references[workers])


@nightly
def test_sigkill_at_a_random_step_without_workers(tmp_path: Path, references: dict) -> None:
    step = random.Random(SEED + 5).randint(3, 37)
    _check(run_drill(Drill(fault="sigkill", step=step, rank=0, workers=0), tmp_path), references[0])


@nightly
@pytest.mark.parametrize("index", range(int(os.environ.get("DRILL_N", "0"))))
def test_random_drill(tmp_path: Path, references: dict, index: int) -> None:
    drill = random_drills(SEED, index + 1)[index]
    _check(run_drill(drill, tmp_path), references[drill.workers])
