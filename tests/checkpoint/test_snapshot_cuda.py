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


def test_overlapped_copy_is_ordered_before_the_optimizer_not_the_forward() -> None:
    """With ``overlap`` the training stream does not wait for the parameter copies at capture; ``order_inflight``
    (the optimizer pre-hook) orders the in-place update after them, so the snapshot keeps the pre-step values."""
    w = torch.randn(2048, 2048, device="cuda")
    before = w.cpu()
    pool = SnapshotPool(max_slots=2)
    slot = pool.capture(1, flatten_state({"w": w}), {}, overlap=lambda t: True)
    activations = w @ w  # the next forward: queued without waiting for the copy
    pool.order_inflight()  # the optimizer pre-hook
    w.add_(1.0)  # the optimizer step
    assert torch.equal(slot.view().tensors["w"], before)
    assert torch.isfinite(activations).all()
    pool.release(slot)
    pool.close()
