"""Stateful loaders under faults: the user's script with the train loaders of torchdata and Hugging Face ``datasets``
(``tests/drills/_loader_script.py``: ``StatefulDataLoader(shuffle=True)``, a ``StatefulDataLoader`` with the user's
``DistributedSampler``, a Hugging Face map-style ``Dataset`` and an ``IterableDataset`` with state), the default
preset, DDP on 2 CPU ranks under torchrun, SIGKILLed mid-epoch in the second epoch, ends bitwise equal to an
uninterrupted run, with loader workers and without.

CI runs the first of them (``StatefulDataLoader(shuffle=True)`` with 2 workers: Lightning wraps torchdata's own
sampler); ``make drills-loaders`` runs them all (``LR_DRILLS=all``). A failing drill prints its seed
(``DRILL_SEED``) and its logs.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.drills._harness import Drill, run_drill
from tests.drills.test_data_drills import ALL, SEED, _check

pytestmark = pytest.mark.slow
pytest.importorskip("torchdata.stateful_dataloader")
pytest.importorskip("datasets")

SCRIPT = Path(__file__).with_name("_loader_script.py")
EPOCH = 26  # batches an epoch on each rank, at most (25; 26 for the iterable dataset read by 2 workers)
nightly = pytest.mark.skipif(not ALL, reason="part of `make drills-loaders` (LR_DRILLS=all), not of CI")

CASES = [
    ("stateful-shuffle", 2),
    pytest.param("stateful-shuffle", 0, marks=nightly),
    pytest.param("stateful-distributed", 0, marks=nightly),
    pytest.param("stateful-distributed", 2, marks=nightly),
    pytest.param("hf-map", 0, marks=nightly),
    pytest.param("hf-map", 2, marks=nightly),
    pytest.param("hf-iterable", 0, marks=nightly),
    pytest.param("hf-iterable", 2, marks=nightly),
]


@pytest.mark.parametrize(("loader", "workers"), CASES)
def test_sigkill_in_the_second_epoch(tmp_path: Path, loader: str, workers: int) -> None:
    # the local tier persists every 10 steps: a kill after step 31 to 38 resumes from step 30, 4 or 5 batches into
    # the second epoch
    step = random.Random(f"{SEED} {loader} {workers}").randint(31, 38)
    drill = Drill(fault="sigkill", step=step, rank=1, workers=workers, script=SCRIPT, args=("--loader", loader))
    reference = run_drill(drill.reference, tmp_path / "reference")
    assert all(r["restored_step"] is None for r in reference.reports.values()), "the reference restored"
    result = run_drill(drill, tmp_path / "faulty")
    _check(result, reference.weights())
    assert all(r["restored_step"] > EPOCH for r in result.reports.values() if r.get("restored_step") is not None)
