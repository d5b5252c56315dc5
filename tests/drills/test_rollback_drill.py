"""In-process rollback on the user's path: the plain Lightning script of ``_user_script.py`` (default preset,
``DataLoader(shuffle=True)``, dropout and noise, StepLR, DDP on 2 CPU ranks under torchrun) over a dataset with one
sample whose features are NaN whenever it is loaded. The sample lies on one rank at a seeded random step.

The job must roll back in the running process and finish on its first attempt (no restart, no resume from disk)
with finite weights; the run directory must record the rollback and the quarantined sample; and the final weights
must be bitwise equal to a run whose loader never yields the skipped batch: "never saw" means each rank's index list
of epoch 0 (Lightning's ``DistributedSampler``, same seed) without the batch at the bad step's position, on every
rank (a DDP step consumes one batch per rank, so the step's whole global batch is quarantined).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from tests.drills._harness import ROOT, Drill, first_difference, run_drill
from tests.drills._user_code import AugmentedPoints

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = ROOT / "tests" / "drills" / "_rollback_script.py"
BATCH, STEPS, SEED = 8, 14, 1234  # the script's batch size and seed_everything seed


def _epoch0(rank: int) -> list[int]:
    """Rank ``rank``'s index list of epoch 0 as Lightning's injected sampler draws it."""
    sampler = DistributedSampler(AugmentedPoints(), num_replicas=2, rank=rank, shuffle=True, seed=SEED)
    sampler.set_epoch(0)
    return list(sampler)


def test_nan_sample_rolls_back_in_process_and_equals_a_run_that_never_saw_its_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed = int(os.environ.get("DRILL_SEED", "20250601"))
    rng = random.Random(seed)
    position = rng.randint(2, STEPS - 5)  # leaves steps after the detection (read one step late)
    poison = _epoch0(1)[position * BATCH + rng.randrange(BATCH)]
    replay = f"DRILL_SEED={seed} (poisoned sample {poison}, step {position}, rank 1; logs in {tmp_path})"
    monkeypatch.setenv("ROLLBACK_DRILL_POISON", str(poison))
    drill = Drill(steps=STEPS, script=SCRIPT, max_restarts=0, timeout_s=150)
    result = run_drill(drill, tmp_path / "rollback", max_launches=1)

    # finished on its first attempt, nothing restored from a checkpoint, finite weights
    reports = result.reports
    assert sorted(reports) == [(0, 0, 0), (0, 0, 1)], f"{reports} {replay}"
    assert all(r["final_step"] == STEPS and r["restored_step"] is None for r in reports.values()), replay
    weights = result.weights()
    assert all(torch.isfinite(w).all() for w in weights.values()), replay

    # the run directory records the rollback and the quarantined sample
    lines = (tmp_path / "rollback" / "resilience" / "quarantine.jsonl").read_text().splitlines()
    [record] = [json.loads(line) for line in lines]
    assert (record["cause"], record["bad_step"], record["target"]) == ("nonfinite", position, position), replay
    assert record["skipped"] == {str(r): _epoch0(r)[position * BATCH : (position + 1) * BATCH] for r in (0, 1)}
    assert poison in record["skipped"]["1"] and record["steps_lost"] >= 1 and not record["escalated"]
    report = json.loads((tmp_path / "rollback" / "resilience_report.json").read_text())
    policy = report["sections"]["resilience_policy"]
    assert [r["bad_step"] for r in policy["rollback"]["rollbacks"]] == [position] and policy["exit_code"] == 0

    # bitwise equal to the run whose loader never lists that batch
    monkeypatch.setenv("ROLLBACK_DRILL_DROP", str(position))
    reference = run_drill(drill, tmp_path / "reference", max_launches=1)
    assert not (tmp_path / "reference" / "resilience" / "quarantine.jsonl").exists(), "the reference saw the sample"
    assert first_difference(weights, reference.weights()) is None, replay
