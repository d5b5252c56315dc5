"""SDCVerification under Lightning DDP (2 CPU processes on gloo, spawn): a gradient flipped on rank 1 before the
all-reduce is caught by the bucket fingerprints and the replay, named, recomputed in place, and the run ends with
weights bitwise equal to a clean DDP run on both ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_resilience import ResilientDDPStrategy
from lightning_resilience.lightning.callbacks.sdc import SDCVerification
from lightning_resilience.lightning.callbacks.sdc_inject import BitFlipInjection
from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.sdc.inject import FlipSpec
from tests.lightning._training import assert_bitwise_equal, build, trainer, weights

pytestmark = pytest.mark.timeout(150)

STEPS = 8
WORLD = 2


class _Dump(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        rank = trainer.global_rank
        torch.save(weights(pl_module), self.out / f"w{rank}.pt")
        sdc = [c for c in trainer.callbacks if isinstance(c, SDCVerification)]  # type: ignore[attr-defined]
        (self.out / f"r{rank}.json").write_text(json.dumps(sdc[0].report() if sdc else {}))


def _run(out: Path, callbacks: list[Callback]) -> tuple[list[dict[str, torch.Tensor]], list[dict]]:
    out.mkdir()
    model, data = build()
    strategy = ResilientDDPStrategy(start_method="spawn")
    trainer(STEPS, [*callbacks, _Dump(out)], devices=WORLD, strategy=strategy).fit(model, datamodule=data)
    ws = [torch.load(out / f"w{r}.pt", weights_only=True) for r in range(WORLD)]
    return ws, [json.loads((out / f"r{r}.json").read_text()) for r in range(WORLD)]


def test_lightning_ddp_gradient_flip_fixed_in_place(tmp_path: Path) -> None:
    clean, _ = _run(tmp_path / "clean", [])
    sdc = SDCVerification(SDCConfig(replay_every_n_steps=2, reconcile_every_n_steps=2))
    inject = BitFlipInjection([FlipSpec("grad", step=3, rank=1, bit_class="sign", seed=8)])
    flipped, reports = _run(tmp_path / "flipped", [sdc, inject])
    for r in range(WORLD):
        assert_bitwise_equal(flipped[r], clean[0])
        assert reports[r]["detections"] == {"transient": 1} and reports[r]["recomputed"] == 1
        [event] = reports[r]["events"]
        assert event["suspects"] == [1] and event["step"] == 4 and event["action"] == "recomputed"
        assert reports[r]["reconcile_rounds"] >= STEPS // 2 and not reports[r]["stopped"]
