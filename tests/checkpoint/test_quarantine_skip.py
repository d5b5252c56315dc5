"""Quarantined batches at the level of indices: a loader whose saved position names batches to skip hands out the
epoch's order without them, resumes across them, carries them to the next epoch, and seeds its workers by the count
of batches handed out (so the batches after a skipped one draw what they would had the sampler never listed it)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_resilience.checkpoint.data_position import SeededIndices, raw_position
from lightning_resilience.checkpoint.dataloader import LoaderCursor


def _loader() -> DataLoader[Any]:
    return DataLoader(list(range(40)), batch_size=4, shuffle=True)


def _epoch_order(seed: int) -> list[list[int]]:
    torch.manual_seed(seed)
    return [b.tolist() for b in _loader()]


def test_raw_position_counts_past_skipped_positions() -> None:
    assert [raw_position(k, {2, 3}) for k in range(5)] == [0, 1, 4, 5, 6]
    assert raw_position(0, {0}) == 1 and raw_position(3, set()) == 3


def test_a_quarantined_batch_is_never_handed_out_and_resumes_step_over_it() -> None:
    full = _epoch_order(7)
    torch.manual_seed(7)
    loader = _loader()
    cursor = LoaderCursor(loader)
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(3)]
    state = cursor.state_dict(consumed=3)
    state["skip"] = [4]  # the batch after the next one is quarantined
    assert cursor.load_state_dict(state)
    assert len(loader) == 9
    rest = [b.tolist() for b in loader]
    assert seen + rest == full[:4] + full[5:]
    # a later resume (a restart) inside the same epoch still leaves it out
    again = cursor.state_dict(consumed=5)
    assert again["skip"] == [4]
    assert cursor.load_state_dict(again)
    assert [b.tolist() for b in loader] == full[6:]


def test_a_batch_quarantined_for_the_next_epoch_waits_for_it() -> None:
    torch.manual_seed(3)
    loader = _loader()
    cursor = LoaderCursor(loader)
    first = [b.tolist() for b in loader]
    state = cursor.state_dict(consumed=10)
    state["skip_next"] = [0]
    assert not cursor.load_state_dict(state)  # the epoch is over: the next one starts fresh
    rng = torch.get_rng_state()
    second = [b.tolist() for b in loader]
    torch.set_rng_state(rng)
    reference = [b.tolist() for b in DataLoader(list(range(40)), batch_size=4, shuffle=True)]
    assert second == reference[1:] and len(first) == 10
    assert cursor.state_dict(consumed=9)["skip"] == [0]


def test_worker_seeds_follow_the_batches_handed_out() -> None:
    loader = DataLoader(list(range(40)), batch_size=4, shuffle=True, num_workers=2)
    cursor = LoaderCursor(loader)
    sampler = cursor.sampler
    plain = list(iter(sampler))
    epoch = sampler.epoch
    assert epoch is not None
    sampler.skip = set()
    sampler.resume_at(0, epoch)
    sampler.skip = {1}
    skipped = list(iter(sampler))
    assert all(isinstance(b, SeededIndices) for b in plain + skipped)
    assert [b.indices for b in skipped] == [b.indices for b in plain[:1] + plain[2:]]
    assert [b.seed for b in skipped] == [b.seed for b in plain[:-1]]
    assert sampler.recent[2] == plain[2].indices and 1 not in sampler.recent
