"""The position of a loader that keeps its own state (torchdata's ``StatefulDataLoader`` over an iterable dataset with
``state_dict`` / ``load_state_dict``, e.g. a Hugging Face ``datasets.IterableDataset``), aligned with the batches
training consumed.

**Aligned with training.** Such a loader's ``state_dict`` describes the batches its iterator has handed out. A trainer
that fetches ahead (Lightning does for loaders without a length, to know the last batch in advance) has taken a batch
more than it trained on, so the loader's state at a checkpoint is a batch ahead, and a resume from it skips that
batch. :class:`StatefulPosition` records the loader's state as training goes, with the number of batches handed out
by then and the global random generators' states (what the next batch fetched in this process draws from), and saves
the newest record not ahead of the batches consumed. A resume loads it and fetches the next batch from those
generators; the batches between the record and the consumed ones (at most the first batch of an epoch, which is
fetched before any hook can record) are fetched again and dropped.

**The resumed epoch alone.** A state loaded into a dataset can stay with it: a Hugging Face ``IterableDataset``
starts every later iteration from a loaded state until its epoch changes, and nothing changes it under Lightning.
An uninterrupted run never loads a state, so after a resume only the resumed epoch may see one: without workers the
resumed epoch iterates a deep copy of the dataset (the loader's dataset is loaded in the main process); with workers
the state goes to the workers, and persistent workers, which would keep it, are started anew before the next epoch.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset

from lightning_resilience.checkpoint.dataloader import drop_persistent_iterator
from lightning_resilience.checkpoint.rng import capture_rng_states, restore_rng_states

__all__ = ["StatefulPosition", "is_stateful_dataloader"]

_KEPT = 2  # the newest records: a checkpoint reads the one just before the batch fetched ahead


def is_stateful_dataloader(loader: Any) -> bool:
    """torchdata's ``StatefulDataLoader`` (when torchdata is installed): a ``DataLoader`` that saves its own position,
    and whose ``load_state_dict({})`` leaves it as it is."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return False
    return isinstance(loader, StatefulDataLoader)


@dataclass
class _Record:
    epoch: int
    handed: int
    """Batches of the epoch the loader had handed out."""
    state: dict[str, Any] | None
    """The loader's state then (None: the epoch's start, nothing handed out)."""
    rng: dict[str, Any] | None
    """The global generators then: the next batch fetched in this process draws from them."""


class StatefulPosition:
    """Where a stateful loader over an iterable dataset stands, in batches consumed.

    Args:
        loader: a ``StatefulDataLoader`` over an ``IterableDataset`` (typed loosely: torchdata is optional).
    """

    def __init__(self, loader: Any) -> None:
        if not (is_stateful_dataloader(loader) and isinstance(loader.dataset, IterableDataset)):
            raise TypeError(f"a StatefulPosition needs a StatefulDataLoader over an IterableDataset, got {loader!r}")
        self.loader: Any = loader
        self._records: list[_Record] = []
        self._pending: dict[str, Any] | None = None
        self._resumed_epoch: int | None = None

    def start_epoch(self, epoch: int) -> None:
        """Before ``epoch``'s iterator is created: it starts from the epoch's beginning. Persistent workers that
        received a resumed epoch's state are started anew."""
        if self._resumed_epoch is not None and self._resumed_epoch != epoch:
            if self.loader.persistent_workers and self.loader.num_workers > 0:
                drop_persistent_iterator(self.loader)
                # an uninterrupted run created the iterator long ago, drawing its seed then: it is reused from here
                current = torch.get_rng_state()
                iter(self.loader)
                torch.set_rng_state(current)
            self._resumed_epoch = None
        if not self._records or self._records[0].epoch != epoch:
            self._records = [_Record(epoch, 0, None, capture_rng_states())]

    def record(self, epoch: int, handed: int) -> None:
        """The loader has handed out ``handed`` batches of ``epoch`` and fetches its next one from the generators'
        current states: keep both for a later checkpoint (called again at the same count, it updates the states)."""
        if not self._records or self._records[0].epoch != epoch:
            self._records = [_Record(epoch, 0, None, None)]  # the epoch's start was not seen: a last resort
        newest = self._records[-1]
        if handed == newest.handed and newest.state is not None:
            newest.rng = capture_rng_states()
        elif handed > newest.handed:
            state = copy.deepcopy(self.loader.state_dict())  # the loader may hand out live dicts it changes later
            newest = _Record(epoch, handed, state, capture_rng_states())
            self._records = [*self._records[:1], *self._records[1:][-_KEPT:], newest]

    def state_dict(self, epoch: int, consumed: int) -> dict[str, Any]:
        """The position after ``consumed`` batches of ``epoch``: the newest record not ahead of it."""
        if not self._records or self._records[0].epoch != epoch:
            self._records = [_Record(epoch, 0, None, None)]
        best = max((r for r in self._records if r.handed <= consumed), key=lambda r: r.handed)
        return {
            "kind": "stateful", "epoch": int(epoch), "consumed": int(consumed),
            "handed": best.handed, "state": best.state, "rng": best.rng,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any], epoch: int) -> bool:
        """Make the loader's next iteration continue the saved position if it belongs to ``epoch``; returns whether it
        does (an epoch is open)."""
        self._pending = None
        if state.get("kind") != "stateful" or int(state.get("epoch", -1)) != epoch or not state.get("consumed"):
            return False
        self._pending = state
        return True

    @property
    def resuming(self) -> bool:
        """The loader's next iteration continues a loaded position (:meth:`resumed`)."""
        return self._pending is not None

    @contextmanager
    def resumed(self, epoch: int) -> Iterator[None]:
        """While open, the loader's next ``iter()`` continues the loaded position, and the batch fetched next draws
        from the generators of the saved record (the caller puts its own generators back afterwards). The batches
        between the record and the consumed ones are fetched again and dropped here."""
        pending, self._pending = self._pending, None
        if pending is None:
            yield
            return
        loader, dataset, generator = self.loader, self.loader.dataset, self.loader.generator
        if pending.get("rng") is not None:
            restore_rng_states(pending["rng"])
        if loader.num_workers == 0:  # loaded in this process: only the resumed epoch's copy may keep it
            object.__setattr__(loader, "dataset", copy.deepcopy(dataset))
        try:
            state, consumed = pending["state"], int(pending["consumed"])
            loader.load_state_dict(state if state is not None else {})
            if consumed > int(pending["handed"]):
                # an iterator created as the interrupted epoch's was, and the batches consumed after the record
                dropped = iter(loader)
                for _ in range(consumed - int(pending["handed"])):
                    next(dropped, None)
                state = copy.deepcopy(loader.state_dict())
                loader.load_state_dict(state)
                del dropped
            # the iterator created next continues a state: the seed it draws from the loader's generator is replaced
            # by the saved one, and drawing it from the global generator would shift the next batch's draws
            loader.generator = torch.Generator()
            self._records = [_Record(epoch, consumed, state, capture_rng_states())]
            self._resumed_epoch = epoch
            yield
        finally:
            loader.generator = generator
            object.__setattr__(loader, "dataset", dataset)
