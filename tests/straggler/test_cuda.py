"""The CUDA path (needs a GPU; skipped without one): CUDA-event timing, the wait probe and the detector's whole step
path run without a single host-device synchronisation, and the figures arrive once the device has finished."""

from __future__ import annotations

import pytest
import torch

from lightning_resilience.straggler import COMPUTE, DATA, STEP, WAIT, StragglerDetector
from lightning_resilience.straggler.config import StragglerConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_step_path_has_no_host_device_sync_and_times_device_work() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
    batches = [torch.randn(512, 1024, device="cuda") for _ in range(4)]
    detector = StragglerDetector(StragglerConfig(warmup_steps=0))
    assert detector.attach(model) == "none"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call on the step path raises
    try:
        for step in range(12):
            detector.start_step()
            with detector.section("forward"):
                loss = model(batches[step % 4]).square().mean()
            with detector.backward(loss):
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            detector.end_step(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    records = detector.timer.collect()  # the device is done: the remaining steps are all readable now
    assert detector.gathers + len(records) >= 1
    for record in records:
        assert record[STEP] > 0 and record["forward"] <= record[STEP]
        assert record[COMPUTE] == pytest.approx(record[STEP] - record.get(WAIT, 0.0))
        assert record.get(DATA, 0.0) >= 0
