"""CUDA path of the snapshot pool: pinned host buffers, device-to-host copies on a side stream, event wait."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

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


def test_shared_memory_buffers_are_page_locked_and_committed_after_the_device_copy(tmp_path: Path) -> None:
    """In shared memory the buffers are registered with CUDA (the copy from the device stays asynchronous), and the
    marker of a step is written only once the copy's event has completed."""
    from lightning_resilience.checkpoint.manager import CheckpointManager
    from lightning_resilience.checkpoint.memory import MemoryTier
    from lightning_resilience.checkpoint.shared_memory import _read_marker

    tier = MemoryTier(keep=2, shared_memory=True, shm_dir=str(tmp_path), run_id="cuda")
    manager = CheckpointManager([tier])
    manager.setup()
    w = torch.randn(2048, 2048, device="cuda")
    manager.on_step(1, lambda: {"w": w}, overlap=lambda t: True)
    (slot,) = [s for s in manager._pool._slots if s.step == 1]
    assert slot.arena is not None and slot.arena.segment is not None and slot.arena.segment.pinned
    assert slot.view().tensors["w"].is_pinned()
    manager.wait_snapshot()
    manager._pool._copier.close(timedelta(seconds=30))  # drains its queue: the marker job has run
    info = _read_marker(slot.arena.segment.marker, slot.arena.segment.path)
    assert info is not None and info["step"] == 1
    assert torch.equal(slot.view().tensors["w"], w.cpu())
    manager.close(finished=True)
