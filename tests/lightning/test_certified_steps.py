"""Certified steps through Lightning: a tier that saves another step's tensors is refused at the restore and the job
takes the step before it; a corruption that reached the durable tier before it was detected is rejected there (the
next job never restores it, ``ckpt ls`` says so), with a culprit named only by a majority of three replicas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_resilience import LocalTier, MemoryTier, ResilientDDPStrategy, TieredCheckpoint
from lightning_resilience.checkpoint.certify import TOMBSTONE
from lightning_resilience.checkpoint.tier import TierIdentity
from lightning_resilience.cli import main
from lightning_resilience.lightning.callbacks.policy import ResiliencePolicy
from lightning_resilience.lightning.callbacks.sdc import SDCVerification
from lightning_resilience.lightning.callbacks.sdc_inject import BitFlipInjection
from lightning_resilience.policy import PolicyConfig
from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.sdc.inject import FlipSpec
from lightning_resilience.testing.faults import FaultPlan
from tests.lightning._training import assert_bitwise_equal, build, trainer, weights

pytestmark = pytest.mark.timeout(240)


def _tiers(root: Path, durable_every: int = 3) -> list[object]:
    return [MemoryTier(every_n_steps=1, keep=2), LocalTier(root / "durable", every_n_steps=durable_every, keep=10,
                                                           name="durable")]  # fmt: skip


def test_a_tier_that_saved_another_steps_tensors_is_refused_and_the_step_before_is_restored(tmp_path: Path) -> None:
    model, data = build()
    trainer(8, [], default_root_dir=tmp_path).fit(model, datamodule=data)
    clean = weights(model)
    tiers = _tiers(tmp_path)
    FaultPlan().fail_at(None, 6, "tier.durable.write", "stale").instrument(tiers[1])  # step 6 holds step 4's
    model, data = build()
    trainer(6, [TieredCheckpoint(tiers)], default_root_dir=tmp_path).fit(model, datamodule=data)
    # the step before it: the newest the tier persisted before 6 (a persist still running defers one)
    before = max(s for s in tiers[1].list_steps() if s < 6)
    again = TieredCheckpoint(_tiers(tmp_path))
    model, data = build()
    trainer(8, [again], default_root_dir=tmp_path).fit(model, datamodule=data)
    assert again.stats.restored_step == before
    [skipped] = again.stats.skipped_corrupt
    assert "tier 'durable'" in skipped and "step 6 are not the state that was snapshotted" in skipped
    assert_bitwise_equal(weights(model), clean)  # an exact resume from that step


class _Report(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        sdc = next(c for c in trainer.callbacks if isinstance(c, SDCVerification))  # type: ignore[attr-defined]
        (self.out / f"r{trainer.global_rank}.json").write_text(json.dumps(sdc.report()))


@pytest.mark.parametrize(("world", "verdict", "suspects"), [(2, "inconclusive", []), (3, "diverged", [1])])
def test_a_step_persisted_after_an_undetected_corruption_is_rejected_in_the_durable_tier(
    tmp_path: Path, world: int, verdict: str, suspects: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1's parameters get a low mantissa bit flipped as step 7 starts (no guard sees it); the durable tier
    persists a step of the diverged replicas (9, or 10 when a persist still running deferred it); the
    reconciliation of step 12 finds the divergence. Every rank rejects the steps after the verified step 6 in every
    tier and stops; two replicas name nobody, three name rank 1."""
    sdc = SDCVerification(SDCConfig(replay_every_n_steps=0, reconcile_every_n_steps=6, run_dir=str(tmp_path)))
    inject = BitFlipInjection([FlipSpec("param", step=7, rank=1, bit_class="mantissa_low", seed=2)])
    policy = ResiliencePolicy(PolicyConfig(exit_after_fit=False))
    model, data = build()
    strategy = ResilientDDPStrategy(start_method="spawn")
    callbacks = [TieredCheckpoint(_tiers(tmp_path)), sdc, inject, policy, _Report(tmp_path)]
    trainer(16, callbacks, devices=world, strategy=strategy, default_root_dir=tmp_path).fit(model, datamodule=data)
    reports = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(world)]
    rejected = sorted(int(p.parent.name.split("_")[1]) for p in (tmp_path / "durable").glob(f"*/{TOMBSTONE}"))
    # a step of the diverged replicas (after 7) had reached the durable tier; everything after step 6 is rejected
    assert rejected and min(rejected) > 6 and max(rejected) > 7, rejected
    kept: list[int] = []
    for rank in range(world):  # the next job never restores them: no rank's durable tier lists them
        durable = LocalTier(tmp_path / "durable", every_n_steps=3, keep=10, name="durable")
        durable.bind_for_reading(TierIdentity(rank, world))
        kept = durable.list_steps()
        assert kept and max(kept) <= 6, kept
    for report in reports:
        [event] = [e for e in report["events"] if e["verdict"] != "clean"]
        assert (event["step"], event["verdict"], event["suspects"]) == (12, verdict, suspects), event
        assert report["stopped"] and set(rejected) <= set(report["rejected_steps"])
        assert all(s > 6 for s in report["rejected_steps"])  # the evidence reaches back to the last clean check
        assert report["rollback_step"] == (6 if 6 in kept else None)
    assert main(["ckpt", "ls", str(tmp_path / "durable")]) == 0
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.count("│") > 3}
    assert all("rejected: SDC at step 12" in rows[str(s)] for s in rejected)
    assert all("unverified" in rows[str(s)] or "verified" in rows[str(s)] for s in kept)


def test_the_report_shows_the_newest_verified_step_and_the_rejected_steps() -> None:
    from lightning_resilience.report.render import _detection_rows

    section = {"newest_verified_step": 6, "rejected_steps": [9, 10], "events": [], "detections": {"diverged": 1}}
    rows = dict(_detection_rows({"sdc_verification": section}))
    assert rows["sdc_verification newest verified step"] == "6"
    assert rows["sdc_verification rejected checkpoint steps"] == "9, 10 (every tier)"
