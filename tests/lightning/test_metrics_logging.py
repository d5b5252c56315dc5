"""Our callbacks log host values straight to the loggers at Lightning's cadence (``log_every_n_steps``), not a
device tensor per value per step."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_resilience import MemoryTier, ResiliencePolicy, TieredCheckpoint
from lightning_resilience.lightning.callbacks.sdc import SDCVerification
from lightning_resilience.sdc.config import SDCConfig
from tests.lightning._training import build, trainer

pytestmark = pytest.mark.timeout(120)


def test_metrics_reach_the_logger_at_the_logging_cadence(tmp_path: Path) -> None:
    model, data = build()
    logger = CSVLogger(tmp_path / "logs")
    callbacks = [SDCVerification(SDCConfig(replay_every_n_steps=4)), TieredCheckpoint([MemoryTier(every_n_steps=1)]),
                 ResiliencePolicy()]  # fmt: skip
    fit = trainer(10, callbacks, logger=logger, log_every_n_steps=5)
    fit.fit(model, datamodule=data)
    logger.save()
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))

    def steps(name: str) -> list[int]:
        return [int(r["step"]) for r in rows if r.get(name) not in ("", None)]

    assert steps("resilience/checkpoint/blocking_ms") == [5, 10]
    assert steps("resilience/sdc/replays") == [5, 10]
    replays = [float(r["resilience/sdc/replays"]) for r in rows if r.get("resilience/sdc/replays")]
    assert replays == [1.0, 2.0]  # replays at steps 4 and 8
    blocking = [float(r["resilience/checkpoint/blocking_ms"]) for r in rows if r["resilience/checkpoint/blocking_ms"]]
    assert len(blocking) == 2 and all(b > 0 for b in blocking)
