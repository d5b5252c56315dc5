"""Injection as the field sees it: multi-bit bursts, strided flips, a faulty device at a rate, and a tier that saves
another step's tensors under a new step's name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tier import TierIdentity
from lightning_resilience.sdc.inject import BitFlipInjector, FlipSpec
from lightning_resilience.testing.faults import FaultPlan


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32)


def test_a_multi_bit_strided_flip_changes_exactly_its_bits_and_elements() -> None:
    model = nn.Linear(8, 8)
    before = _bits(model.weight).clone()
    spec = FlipSpec("param", step=0, target="weight", element=3, bit=27, bits=3, elements=4, stride=10)
    record = BitFlipInjector(model).inject(spec)
    assert record is not None and record.elements == [3, 13, 23, 33] and record.bits == [27, 26, 25]
    changed = (before ^ _bits(model.weight)).tolist()
    assert {i for i, x in enumerate(changed) if x} == {3, 13, 23, 33}
    assert all(changed[i] == 0b111 << 25 for i in (3, 13, 23, 33))


def test_strided_elements_wrap_and_never_flip_one_element_twice() -> None:
    model = nn.Linear(2, 2)  # 4 weights
    spec = FlipSpec("param", step=0, target="weight", element=1, bit=30, elements=6, stride=2)
    record = BitFlipInjector(model).inject(spec)
    assert record is not None and record.elements == [1, 3]  # 1, 3, 5%4=1 (already), ...


def _faulty_run(rate: float, calls: int, seed: int = 3) -> list[int]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    injector = BitFlipInjector(model)
    injector.faulty_device("grad", 1, target="weight", rate=rate, seed=seed)
    for _ in range(calls):
        model(torch.ones(1, 4)).sum().backward()
    return [r.call for r in injector.records]


def test_a_faulty_device_at_a_rate_corrupts_about_that_share_of_its_results_reproducibly() -> None:
    always = _faulty_run(1.0, 50)
    assert always == list(range(1, 51))
    flaky = _faulty_run(0.2, 400)
    assert 40 <= len(flaky) <= 120 and flaky == _faulty_run(0.2, 400)  # seeded: the same calls again
    assert flaky != _faulty_run(0.2, 400, seed=4)
    with pytest.raises(ValueError, match="rate"):
        BitFlipInjector(nn.Linear(1, 1)).faulty_device("grad", rate=0.0)


def _snap(step: int, value: float) -> StagedSnapshot:
    return StagedSnapshot(step, {"t": {"t": "w"}}, {"w": torch.full((4,), value)}, {"n": step})


def test_a_stale_write_commits_the_previous_steps_tensors_under_the_new_name(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path, every_n_steps=1, keep=5)
    tier.bind(TierIdentity())
    plan = FaultPlan().fail_at(None, 2, "tier.local.write", "stale")
    plan.instrument(tier)
    tier.write(_snap(1, 1.0))
    tier.write(_snap(2, 2.0))  # succeeds, silently
    stale = tier.read(2)
    assert stale.step == 2 and stale.meta["n"] == 2 and torch.equal(stale.tensors["w"], torch.full((4,), 1.0))
    assert [f.action for f in plan.fired] == ["stale"]
