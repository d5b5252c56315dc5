"""Where an epoch stands, at the level of indices: a batch sampler that starts at batch ``k`` without fetching the
``k`` batches before it, and per-batch seeds that make worker-side randomness independent of which worker fetches a
batch, or of whether the workers were restarted.

**Order.** An epoch's index order is fixed by the sampler (a ``DistributedSampler``'s seed and epoch) and by the
random generators it draws from when its iteration starts (``RandomSampler`` draws its seed from the global torch
RNG, or uses its own ``torch.Generator``). :class:`ResumableBatchSampler` records those generators' states at that
moment (:class:`EpochStart`); to resume at batch ``k`` it puts them back, lets the wrapped sampler draw the same
order, skips ``k`` batches of *indices* (nothing is fetched, nothing collated) and returns the global generators to
the state they had, so resuming adds or loses no random draw.

**Worker randomness.** A DataLoader seeds worker ``w`` once with ``base_seed + w``; its RNG then advances with every
sample that worker processes, and which worker processes which batch depends on the round-robin since the iterator
was created. A resumed run that skips batches (and restarts its workers) cannot continue those streams. With
workers, every batch of indices therefore carries a seed derived from (epoch seed, batch position); the worker
re-seeds Python's, NumPy's and torch's generators with it right before it fetches the batch (:class:`SeededIndices`
does it while being unpickled, so the dataset only ever sees the plain indices). The same scheme runs with or
without a fault, so an uninterrupted run and a resumed one draw the same numbers for every batch.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
import torch
import xxhash
from torch.utils.data import BatchSampler, Sampler

from lightning_resilience.checkpoint.rng import capture_rng_states, restore_rng_states

__all__ = ["EpochStart", "ResumableBatchSampler", "SeededIndices", "batch_seed", "raw_position", "seed_worker"]

_MASK64 = (1 << 64) - 1


def batch_seed(epoch_seed: int, position: int) -> int:
    """The seed of batch ``position`` of an epoch (splitmix64 of the pair; 63 bits, valid for every generator)."""
    z = (epoch_seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def seed_worker(seed: int) -> None:
    """Seed the generators a dataset draws from in a worker: Python's, NumPy's global one and torch's."""
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.manual_seed(seed)


def _reseeded(seed: int, indices: Any) -> Any:
    seed_worker(seed)
    return indices


class SeededIndices:
    """A batch of indices on its way to a DataLoader worker, with the seed of its batch.

    Indices reach a worker pickled through its index queue, and the worker fetches the batch right after taking it
    off the queue. Unpickling this object re-seeds the worker's generators and yields the plain indices, so the
    dataset and the collate function never see it.
    """

    __slots__ = ("indices", "seed")

    def __init__(self, indices: Any, seed: int) -> None:
        self.indices = indices
        self.seed = seed

    def __reduce__(self) -> tuple[Callable[[int, Any], Any], tuple[int, Any]]:
        return _reseeded, (self.seed, self.indices)


@dataclass
class EpochStart:
    """What fixed an epoch's order: the generators' states when its sampler started, and its worker seed."""

    rng: dict[str, Any]
    """Global generators (Python, NumPy, torch) when the sampler's iteration started."""
    generators: list[torch.Tensor]
    """States of the loader's and samplers' own ``torch.Generator`` objects then."""
    seed: int
    """Per-batch worker seeds derive from it (:func:`batch_seed`)."""

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng, "generators": [g.clone() for g in self.generators], "seed": str(self.seed)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EpochStart:
        return cls(
            rng=state["rng"],
            generators=[torch.as_tensor(g, dtype=torch.uint8).clone() for g in state.get("generators", [])],
            seed=int(state["seed"]),
        )


def raw_position(yielded: int, skip: Iterable[int]) -> int:
    """The position in the sampler's full order of the batch handed out ``yielded``-th (0-based) when the positions
    in ``skip`` are left out."""
    raw = yielded
    for k in sorted(set(skip)):
        if k <= raw:
            raw += 1
    return raw


def _consume(it: Iterator[Any], n: int) -> None:
    """Advance ``it`` by ``n`` items at C speed (the itertools recipe)."""
    if n > 0:
        next(itertools.islice(it, n, n), None)


def _primed(it: Iterator[Any]) -> Iterator[Any]:
    """``it`` with its first item already drawn: a lazy sampler makes its random draws now, not later."""
    sentinel = object()
    first = next(it, sentinel)
    return it if first is sentinel else itertools.chain((first,), it)


def _chunks_its_sampler(batch_sampler: Any) -> TypeGuard[BatchSampler]:
    """Its batches are consecutive chunks of its sampler's indices: torch's ``BatchSampler``, or torchdata's (the same
    batching, with a state of its own)."""
    if type(batch_sampler) is BatchSampler:
        return True
    try:
        from torchdata.stateful_dataloader.sampler import BatchSampler as StatefulBatchSampler
    except ImportError:
        return False
    return type(batch_sampler) is StatefulBatchSampler


class _Resumed:
    """An iterable over an already advanced iterator (what a BatchSampler needs as its sampler)."""

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it

    def __iter__(self) -> Iterator[Any]:
        return self._it


class ResumableBatchSampler(Sampler[Any]):
    """Wraps a DataLoader's index sampler (its batch sampler, or its sampler when batching is off).

    Args:
        inner: the index sampler it replaces in the loader.
        generators: the ``torch.Generator`` objects the epoch's order draws from besides the global one (the
            loader's ``generator``, a sampler's ``generator``).
        seeded: attach a per-batch seed to every batch (:class:`SeededIndices`); for loaders with workers.
        salt: mixed into the epoch seed (e.g. the global rank), so ranks with equal generators draw differently.
    """

    def __init__(self, inner: Iterable[Any], generators: list[torch.Generator], *, seeded: bool, salt: int = 0) -> None:
        self.inner = inner
        # Lightning sets the epoch on ``loader.batch_sampler.sampler``: the DistributedSampler stays reachable
        self.sampler = getattr(inner, "sampler", None)
        self.generators = generators
        self.seeded = seeded
        self.salt = salt
        self.epoch: EpochStart | None = None
        self._resume: tuple[int, EpochStart] | None = None
        self.skip: set[int] = set()
        """Positions (in the full order) of the current epoch that are never handed out (quarantined batches)."""
        self.skip_next: set[int] = set()
        """The same for the epoch after it."""
        self.recent: dict[int, Any] = {}
        """Position -> indices of the last batches handed out in the current epoch (a few, for the quarantine)."""

    def __len__(self) -> int:
        return len(self.inner) - len(self.skip)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped sampler when it is epoch-aware (Lightning calls it when batching is off)."""
        set_epoch = getattr(self.inner, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def resume_at(self, start: int, epoch: EpochStart) -> None:
        """Make the next iteration continue ``epoch`` after ``start`` handed-out batches (positions in ``skip`` are
        not counted); consumed by the first iteration only."""
        self._resume = (start, epoch)

    @property
    def resume_position(self) -> int | None:
        """The batch the next iteration starts at, when it continues a saved epoch."""
        return None if self._resume is None else self._resume[0]

    @property
    def open_epoch(self) -> EpochStart | None:
        """The epoch the sampler is in: the one its next iteration continues when a saved epoch is loaded, else the
        one it iterates (None: none started)."""
        return self.epoch if self._resume is None else self._resume[1]

    def __iter__(self) -> Iterator[Any]:
        if self._resume is None:  # a new epoch: its quarantined positions were queued as the next epoch's
            self.skip, self.skip_next = self.skip_next, set()
        self.recent = {}
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        # a generator: nothing below runs before the loader asks for its first batch of indices
        resume, self._resume = self._resume, None
        if resume is None:
            handed, start, self.epoch = 0, 0, self._capture()
            it = iter(self.inner)
        else:
            handed, self.epoch = resume
            start = raw_position(handed, self.skip)
            it = self._replay(start, self.epoch)
        epoch_seed = self.epoch.seed
        for position, batch in enumerate(it, start):
            if position in self.skip:
                continue
            self.recent[position] = batch
            self.recent.pop(position - 16, None)
            # seeded by the count handed out: without a quarantined batch, the batches after it draw what they would
            # draw had the sampler never listed it
            yield SeededIndices(batch, batch_seed(epoch_seed, handed)) if self.seeded else batch
            handed += 1

    def _capture(self) -> EpochStart:
        rng = capture_rng_states()
        states = [g.get_state() for g in self.generators]
        digest = xxhash.xxh3_64(rng["torch"].numpy().tobytes())
        for state in states:
            digest.update(state.numpy().tobytes())
        digest.update(self.salt.to_bytes(8, "little", signed=True))
        return EpochStart(rng=rng, generators=states, seed=digest.intdigest() >> 1)

    def _replay(self, start: int, epoch: EpochStart) -> Iterator[Any]:
        current = capture_rng_states()
        try:
            restore_rng_states(epoch.rng)
            for gen, state in zip(self.generators, epoch.generators):
                gen.set_state(state)
            return self._advanced(start)
        finally:  # the epoch's draws were made long ago: leave the streams as the caller had them
            restore_rng_states(current)

    def _advanced(self, start: int) -> Iterator[Any]:
        inner = self.inner
        if _chunks_its_sampler(inner):  # batches are consecutive chunks: skip start * batch_size indices
            indices = _primed(iter(inner.sampler))
            _consume(indices, start * inner.batch_size)
            return iter(BatchSampler(_Resumed(indices), inner.batch_size, inner.drop_last))
        it = _primed(iter(inner))  # any other batch sampler: skip whole batches, still only indices
        _consume(it, start)
        return it
