"""CUDA path of the snapshot pool: pinned host buffers, device-to-host copies on a side stream, event wait."""

from __future__ import annotations

import pytest
import torch

from lightning_resilience.checkpoint.snapshot import SnapshotPool
from lightning_resilience.checkpoint.tree import flatten_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_device_to_host_copy_is_pinned_async_and_exact() -> None:
    """Buffers are pinned; the copy is queued on a side stream and view() waits for it; values match the source."""
    src = {"w": torch.randn(1024, 1024, device="cuda"), "step": torch.tensor(3.0, device="cuda")}
    pool = SnapshotPool(max_slots=2)
    assert pool.pinned
    slot = pool.capture(1, flatten_state(src), {})
    src["w"].add_(1.0)  # queued after the capture on the default stream: must not leak into the snapshot
    view = slot.view()
    assert all(t.is_pinned() for t in view.tensors.values())
    assert torch.equal(view.tensors["w"], (src["w"] - 1.0).cpu())
    pool.release(slot)
