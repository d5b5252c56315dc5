"""SnapshotPool / HostSnapshot: captures are copies, slots are reused and bounded, waits are bounded and woken."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch

from lightning_resilience.checkpoint.snapshot import HostSnapshot, SnapshotPool, StagedSnapshot
from lightning_resilience.checkpoint.tree import FlatState, flatten_state

pytestmark = pytest.mark.timeout(20)

SHORT = timedelta(milliseconds=50)
WAIT = timedelta(seconds=10)


def _state(scale: float = 1.0) -> dict[str, Any]:
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale,
        "half": torch.ones(5, dtype=torch.bfloat16) * scale,
        "count": torch.tensor(int(scale * 10), dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "lr": 0.1 * scale,
    }


def _flat(scale: float = 1.0) -> FlatState:
    return flatten_state(_state(scale))


def _buffers(slot: HostSnapshot) -> dict[str, torch.Tensor]:
    return slot.view().tensors


def test_capture_copies_tensor_values_and_meta() -> None:
    """Mutating the live tensors or meta after capture never changes what the slot holds."""
    pool = SnapshotPool(max_slots=2)
    state = _state()
    expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    meta: dict[str, Any] = {"epoch": 3}
    slot = pool.capture(7, flatten_state(state), meta, timeout=WAIT)
    for value in state.values():
        if isinstance(value, torch.Tensor):
            value.fill_(0) if value.dtype != torch.bool else value.logical_not_()
    state["lr"] = 99.0
    meta["epoch"] = 4
    view = slot.view()
    assert view.step == 7
    assert view.meta == {"epoch": 3}
    assert view.skeleton["d"]["lr"] == pytest.approx(0.1)
    assert view.tensors.keys() == expected.keys()
    for name, want in expected.items():
        got = view.tensors[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name
        assert got.data_ptr() != state[name].data_ptr(), f"{name} aliases the live tensor"
    pool.release(slot)


def test_capture_of_non_contiguous_source() -> None:
    """A transposed (non-contiguous) source tensor is captured with its logical values."""
    pool = SnapshotPool(max_slots=2)
    src = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    slot = pool.capture(1, flatten_state({"t": src}), {}, timeout=WAIT)
    assert torch.equal(_buffers(slot)["t"], src)
    pool.release(slot)


def test_slots_and_buffers_are_reused_with_same_layout() -> None:
    """Capture/release cycles never grow the pool past max_slots and keep writing into the same buffers."""
    pool = SnapshotPool(max_slots=3)
    first = pool.capture(0, _flat(0.0), {}, timeout=WAIT)
    buffers = {n: (b, b.data_ptr()) for n, b in _buffers(first).items()}
    pool.release(first)
    for step in range(1, 12):
        slot = pool.capture(step, _flat(float(step)), {}, timeout=WAIT)
        assert slot is first, "a free slot with the same layout must be reused, not a new one allocated"
        for name, buf in _buffers(slot).items():
            assert buf is buffers[name][0] and buf.data_ptr() == buffers[name][1], name
        assert torch.equal(_buffers(slot)["w"], _state(float(step))["w"])
        assert slot.reallocations == 1
        pool.release(slot)
    assert len(pool._slots) == 1
    assert pool.host_bytes == first.nbytes


def test_pool_never_grows_past_max_slots_under_double_buffering() -> None:
    """Holding one extra reference per capture (a persist in flight) cycles through at most max_slots slots."""
    pool = SnapshotPool(max_slots=2)
    in_flight: HostSnapshot | None = None
    seen: set[int] = set()
    for step in range(10):
        slot = pool.capture(step, _flat(float(step)), {}, timeout=WAIT)
        seen.add(id(slot))
        if in_flight is not None:
            pool.release(in_flight)  # the previous persist finished
        in_flight = slot
        assert len(pool._slots) <= 2
    assert len(seen) == 2
    assert all(s.reallocations == 1 for s in pool._slots)
    assert in_flight is not None
    pool.release(in_flight)


def test_reallocations_count_layout_changes_and_reuse_an_arena_that_fits() -> None:
    """A layout change lays the slot out again and counts once (a new arena only when the old one is too small);
    the same layout counts nothing."""
    pool = SnapshotPool(max_slots=2)
    slot = pool.capture(1, flatten_state({"w": torch.zeros(64)}), {}, timeout=WAIT)
    assert slot.reallocations == 1 and slot.arena is not None
    first_arena = slot.arena.data.data_ptr()
    pool.release(slot)

    # optimizer state appears after the first step: one new tensor, the arena grows
    slot2 = pool.capture(2, flatten_state({"w": torch.ones(64), "m": torch.ones(2, 2)}), {}, timeout=WAIT)
    assert slot2 is slot
    assert slot.reallocations == 2
    assert set(_buffers(slot)) == {"w", "m"}
    assert torch.equal(_buffers(slot)["m"], torch.ones(2, 2)) and torch.equal(_buffers(slot)["w"], torch.ones(64))
    grown = slot.arena.data.data_ptr()
    pool.release(slot)

    slot3 = pool.capture(3, flatten_state({"w": torch.full((64,), 3.0), "m": torch.ones(2, 2)}), {}, timeout=WAIT)
    assert slot3 is slot and slot.reallocations == 2
    pool.release(slot)

    # a dtype change is a layout change too; a dropped tensor disappears from the slot; a smaller layout keeps the
    # arena it fits in
    slot4 = pool.capture(4, flatten_state({"w": torch.zeros(4, dtype=torch.float64)}), {}, timeout=WAIT)
    assert slot4 is slot and slot.reallocations == 3
    assert set(_buffers(slot)) == {"w"}
    assert _buffers(slot)["w"].dtype == torch.float64
    assert slot.arena.data.data_ptr() == grown != first_arena
    pool.release(slot)


def test_every_buffer_of_a_slot_is_an_aligned_part_of_one_arena_with_a_storage_of_its_own() -> None:
    """One allocation per slot; each tensor starts on a 64-byte boundary of it (any dtype may view it), and what the
    slot hands out has a storage of exactly its own bytes (as a plain tensor has: torch.set_rng_state and torch.save
    read the storage)."""
    pool = SnapshotPool(max_slots=2)
    state = {
        "a": torch.ones(3, dtype=torch.bfloat16),
        "b": torch.arange(5),
        "c": torch.tensor(True),
        "d": torch.ones(0),
    }
    slot = pool.capture(1, flatten_state(state), {}, timeout=WAIT)
    assert slot.arena is not None
    base = slot.arena.data.data_ptr()
    for name, buf in _buffers(slot).items():
        if buf.numel():
            assert buf.untyped_storage().data_ptr() == buf.data_ptr() == base + slot.offsets[name]
            assert buf.untyped_storage().nbytes() == buf.numel() * buf.element_size()
            assert slot.offsets[name] % 64 == 0
        assert torch.equal(buf, state[name])
    pool.release(slot)
    rng = pool.capture(2, flatten_state({"pad": torch.ones(3), "rng": torch.get_rng_state()}), {}, timeout=WAIT)
    torch.set_rng_state(rng.view().tensors["rng"])  # not at the arena's start, as a restore hands it over
    pool.release(rng)


def test_capture_reuses_the_oldest_free_slot() -> None:
    """With several free slots the oldest step is overwritten, so the newest snapshots survive longest."""
    pool = SnapshotPool(max_slots=3)
    slots = [pool.capture(step, _flat(float(step)), {}, timeout=WAIT) for step in (1, 2, 3)]
    for slot in slots:
        pool.release(slot)
    reused = pool.capture(4, _flat(4.0), {}, timeout=WAIT)
    assert reused is slots[0]
    assert sorted(s.step for s in pool._slots) == [2, 3, 4]
    pool.release(reused)


def test_capture_times_out_when_every_slot_is_retained() -> None:
    """With all max_slots slots referenced, capture raises TimeoutError after its (short) timeout."""
    pool = SnapshotPool(max_slots=2)
    held = [pool.capture(step, _flat(float(step)), {}, timeout=WAIT) for step in (1, 2)]
    with pytest.raises(TimeoutError, match="max_host_copies"):
        pool.capture(3, _flat(3.0), {}, timeout=SHORT)
    assert len(pool._slots) == 2
    # the held snapshots are untouched by the failed capture
    assert [s.step for s in held] == [1, 2]
    assert torch.equal(_buffers(held[1])["w"], _state(2.0)["w"])
    for slot in held:
        pool.release(slot)


def test_retained_slot_is_not_reused_until_every_reference_is_released() -> None:
    """A slot retained by a tier stays intact after the caller's release, and is reusable after the last one."""
    pool = SnapshotPool(max_slots=2)
    a = pool.capture(1, _flat(1.0), {}, timeout=WAIT)
    pool.retain(a)  # e.g. the RAM tier
    pool.release(a)  # the caller's reference
    b = pool.capture(2, _flat(2.0), {}, timeout=WAIT)
    assert b is not a
    pool.release(b)
    c = pool.capture(3, _flat(3.0), {}, timeout=WAIT)
    assert c is b, "the only free slot must be reused"
    assert a.step == 1 and torch.equal(_buffers(a)["w"], _state(1.0)["w"])
    with pytest.raises(TimeoutError):
        pool.capture(4, _flat(4.0), {}, timeout=SHORT)
    pool.release(a)
    d = pool.capture(4, _flat(4.0), {}, timeout=SHORT)
    assert d is a
    pool.release(c)
    pool.release(d)


def test_release_wakes_a_waiting_capture() -> None:
    """A capture blocked on a full pool proceeds as soon as another thread releases a slot."""
    pool = SnapshotPool(max_slots=2)
    first = pool.capture(1, _flat(1.0), {}, timeout=WAIT)
    second = pool.capture(2, _flat(2.0), {}, timeout=WAIT)

    waiting = threading.Event()
    inner_wait = pool._cond.wait

    def signalling_wait(timeout: float | None = None) -> bool:
        waiting.set()  # still under the condition's lock: release() cannot run before we really wait
        return inner_wait(timeout)

    pool._cond.wait = signalling_wait  # type: ignore[method-assign]
    result: list[HostSnapshot | BaseException] = []

    def capture() -> None:
        try:
            result.append(pool.capture(3, _flat(3.0), {}, timeout=WAIT))
        except BaseException as err:
            result.append(err)

    thread = threading.Thread(target=capture)
    thread.start()
    assert waiting.wait(WAIT.total_seconds()), "capture did not wait for a slot"
    assert not result
    pool.release(first)
    thread.join(WAIT.total_seconds())
    assert not thread.is_alive(), "release did not wake the waiting capture"
    assert len(result) == 1 and result[0] is first, result
    assert first.step == 3 and first.refs == 1
    assert torch.equal(_buffers(first)["w"], _state(3.0)["w"])
    pool.release(first)
    pool.release(second)


def test_double_release_asserts() -> None:
    """Releasing a slot more times than it was referenced is an internal-invariant violation."""
    pool = SnapshotPool(max_slots=2)
    slot = pool.capture(1, _flat(), {}, timeout=WAIT)
    pool.release(slot)
    with pytest.raises(AssertionError, match="double release"):
        pool.release(slot)
    with pytest.raises(AssertionError, match="retain of a released"):
        pool.retain(slot)
    assert slot.refs == 0


def test_view_clone_does_not_alias_reused_buffers() -> None:
    """A StagedSnapshot clone keeps its values after the slot is overwritten by a later capture."""
    pool = SnapshotPool(max_slots=2)
    slot = pool.capture(1, _flat(1.0), {"k": 1}, timeout=WAIT)
    copy: StagedSnapshot = slot.view().clone()
    pool.release(slot)
    again = pool.capture(2, _flat(2.0), {"k": 2}, timeout=WAIT)
    assert again is slot
    assert copy.step == 1 and copy.meta == {"k": 1}
    assert torch.equal(copy.tensors["w"], _state(1.0)["w"])
    assert copy.nbytes == slot.nbytes
    assert copy.specs() == slot.view().specs()
    pool.release(again)


def test_pool_config_validation() -> None:
    """max_slots < 2 cannot double buffer and is rejected at construction; CPU-only pools are never pinned."""
    with pytest.raises(ValueError, match="max_slots"):
        SnapshotPool(max_slots=1)
    if not torch.cuda.is_available():
        assert SnapshotPool(max_slots=2, pin_memory=True).pinned is False
