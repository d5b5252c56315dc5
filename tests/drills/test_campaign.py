"""The bounded CI subset of the fault campaign (``make drills`` runs the rest; docs/reliability.md has its table).

``CAMPAIGN_CI_N`` drills (default 6) of ``tests/drills/campaign.py``, drawn from a seed that rotates with the date
(``DRILL_SEED`` overrides it), each a real torchrun job of the user's path with one random fault, checked bitwise
and for lost steps, corrupt loads, deadlines and leftover processes. One uninterrupted reference run per loader
configuration serves every drill. A failure names the command that replays it: ``make drills N=1 SEED=<seed>``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.drills.campaign import FAULTS, Outcome, References, draw, run_one

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("DRILL_SEED", time.strftime("%Y%m%d", time.gmtime())))
N = int(os.environ.get("CAMPAIGN_CI_N", "6"))


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(tmp_path_factory.mktemp("references"))


def test_every_fault_kind_can_be_drawn() -> None:
    drawn = {draw(seed).fault for seed in range(200)}
    assert drawn == set(FAULTS[1:])


@pytest.mark.parametrize("index", range(N))
def test_random_drill(tmp_path: Path, references: References, index: int) -> None:
    outcome: Outcome = run_one(SEED + index, references, tmp_path)
    print(f"drill seed {outcome.seed}: {outcome.fault} rank {outcome.rank} step {outcome.step}, recovered in "
          f"{outcome.recovery_s} s, restored {outcome.restored}")  # fmt: skip
    assert outcome.ok, f"{outcome.problems}; replay: {outcome.replay()} (run dir {outcome.run_dir})"
