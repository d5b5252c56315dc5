"""CUDA path of the snapshot pool: pinned host buffers, device-to-host copies on a side stream, event wait."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
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
    before = src["w"].clone()  # on the device: no synchronisation before the capture
    pool = SnapshotPool(max_slots=2)
    assert pool.pinned
    slot = pool.capture(1, flatten_state(src), {})
    src["w"].add_(1.0)  # queued after the capture on the default stream: must not leak into the snapshot
    view = slot.view()
    assert all(t.is_pinned() for t in view.tensors.values())
    assert torch.equal(view.tensors["w"], before.cpu())
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


@pytest.fixture
def shm_path() -> Iterator[Path]:
    """A directory on the tmpfs the tier uses by default (a file on a disk filesystem cannot be page-locked)."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("needs /dev/shm")
    path = Path(tempfile.mkdtemp(prefix="lr-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_shared_memory_buffers_are_page_locked_and_committed_after_the_device_copy(shm_path: Path) -> None:
    """In shared memory the buffers are registered with CUDA (the copy from the device stays asynchronous), and the
    marker of a step is written only once the copy's event has completed."""
    from lightning_resilience.checkpoint.manager import CheckpointManager
    from lightning_resilience.checkpoint.memory import MemoryTier
    from lightning_resilience.checkpoint.shared_memory import _read_marker

    tier = MemoryTier(keep=2, shared_memory=True, shm_dir=str(shm_path), run_id="cuda")
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


def test_a_buffer_that_cannot_be_page_locked_leaves_cuda_working(tmp_path: Path) -> None:
    """``shm_dir`` on a disk filesystem: Linux may refuse to page-lock the file's pages. The refusal must not stay
    behind as CUDA's pending error (the next kernel would fail with it): the snapshot is taken, synchronously, and
    the device keeps working."""
    from lightning_resilience.checkpoint.shared_memory import Segment

    seg = Segment(tmp_path / "rank", 1 << 20, pin=True)
    x = torch.arange(1000, device="cuda", dtype=torch.float32)  # a kernel launch after the registration
    assert float((x * 2).sum()) == 999000.0
    seg.data[:4].copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8, device="cuda"))
    assert seg.data[:4].tolist() == [1, 2, 3, 4]
    seg.remove()
