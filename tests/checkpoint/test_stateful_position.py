"""The position of a stateful loader over an iterable dataset, in batches consumed: a consumer that fetches a batch
ahead (as Lightning's does) resumes at the batch after the last one it consumed, not after the one it fetched; the
first batch of an epoch is fetched again and dropped; a loaded state stays with the resumed epoch alone; the batch
fetched next draws from the generators recorded with the state."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset

from lightning_resilience.checkpoint.stateful_position import StatefulPosition, is_stateful_dataloader

stateful = pytest.importorskip("torchdata.stateful_dataloader")


class Counting(IterableDataset[int]):
    """0..n-1 with a state (the next item), like a Hugging Face ``IterableDataset``: a loaded state applies to every
    later iteration; each item draws a random number from the process's generator."""

    def __init__(self, n: int = 12) -> None:
        self.n, self.pos, self.start = n, 0, 0

    def __iter__(self) -> Iterator[Any]:
        self.pos = self.start
        while self.pos < self.n:
            self.pos += 1
            yield [self.pos - 1, random.random()]

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["pos"]


def _loader(workers: int = 0) -> Any:
    return stateful.StatefulDataLoader(Counting(), batch_size=2, num_workers=workers)


def _items(batch: Any) -> list[int]:
    return [int(i) for i in batch[0]]


def _epoch(position: StatefulPosition, epoch: int, consumed: int) -> tuple[dict[str, Any], list[list[int]]]:
    """Run an epoch as Lightning does (a batch fetched ahead, a record after each batch) and stop after ``consumed``
    batches: the saved position and the batches consumed."""
    position.start_epoch(epoch)
    it = iter(position.loader)
    ahead = next(it)
    seen = []
    for _ in range(consumed):
        batch, ahead = ahead, next(it)
        seen.append(_items(batch))
        position.record(epoch, len(seen) + 1)
    return position.state_dict(epoch, consumed), seen


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("consumed", [1, 2, 4])
def test_a_resume_continues_after_the_last_batch_consumed(workers: int, consumed: int) -> None:
    full = [_items(b) for b in _loader(workers)]
    state, seen = _epoch(StatefulPosition(_loader(workers)), 0, consumed)
    assert seen == full[:consumed]
    assert state["consumed"] == consumed and state["handed"] <= consumed
    resumed = StatefulPosition(_loader(workers))  # a new process
    assert resumed.load_state_dict(state, epoch=0) and resumed.resuming
    with resumed.resumed(epoch=0):
        it = iter(resumed.loader)
    assert [_items(b) for b in it] == full[consumed:]


def test_the_resumed_epoch_alone_sees_the_loaded_state() -> None:
    state, _ = _epoch(StatefulPosition(_loader()), 0, 3)
    resumed = StatefulPosition(_loader())
    dataset = resumed.loader.dataset
    assert resumed.load_state_dict(state, epoch=0)
    with resumed.resumed(epoch=0):
        rest = [_items(b) for b in resumed.loader]
    assert rest[0] == [6, 7] and dataset.start == 0  # the user's dataset was not given the state
    resumed.start_epoch(1)
    assert [_items(b) for b in resumed.loader][:1] == [[0, 1]]


def test_the_next_batch_draws_from_the_recorded_generators() -> None:
    random.seed(5)
    uninterrupted = [b[1].tolist() for b in _loader()]
    random.seed(5)
    state, _ = _epoch(StatefulPosition(_loader()), 0, 2)
    random.seed(99)  # the resumed process's generators, restored from its snapshot: not those of the fetch
    resumed = StatefulPosition(_loader())
    resumed.load_state_dict(state, epoch=0)
    before = random.getstate()
    with resumed.resumed(epoch=0):
        it = iter(resumed.loader)
        first = next(it)[1].tolist()
    assert first == uninterrupted[2]
    random.setstate(before)  # what the caller does: the training's own streams go on from the snapshot


def test_a_position_of_another_epoch_or_at_its_start_is_not_resumed() -> None:
    state, _ = _epoch(StatefulPosition(_loader()), 0, 2)
    position = StatefulPosition(_loader())
    assert not position.load_state_dict(state, epoch=1) and not position.resuming
    assert not position.load_state_dict({**state, "consumed": 0}, epoch=0)
    assert not position.load_state_dict({"position": 3}, epoch=0)  # a cursor's state


def test_only_a_stateful_loader_over_an_iterable_dataset() -> None:
    assert is_stateful_dataloader(_loader()) and not is_stateful_dataloader(torch.utils.data.DataLoader([1, 2]))
    with pytest.raises(TypeError, match="StatefulDataLoader over an IterableDataset"):
        StatefulPosition(stateful.StatefulDataLoader(list(range(4)), batch_size=2))
