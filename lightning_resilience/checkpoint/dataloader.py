"""The position of a DataLoader inside its epoch, saved and restored so a resumed run sees exactly the same batches.

:class:`LoaderCursor` attaches to any map-style ``DataLoader`` (whatever its sampler: ``DistributedSampler``,
``RandomSampler``, ``SequentialSampler``, a custom batch sampler) by replacing its index sampler with a
:class:`~lightning_resilience.checkpoint.data_position.ResumableBatchSampler`. Its state is the number of batches
the training consumed in the open epoch plus what fixed that epoch's order and worker seeds; loading it makes the
loader's next iteration start at the next batch, skipping at the level of indices, so resuming costs the same at
batch 10 and at batch 10^6. :class:`~lightning_resilience.TieredCheckpoint` attaches a cursor to each map-style
train loader Lightning builds; :class:`ResumableDataLoader` is the same mechanism as a ``DataLoader`` subclass, for
use without that callback (it implements the ``state_dict`` / ``load_state_dict`` protocol that Lightning's fit
loop saves for stateful loaders).

Elastic restarts: when the job comes back with another number of data-parallel ranks, the position is remapped.
A ``DistributedSampler`` deals the epoch's permutation out round-robin, so after ``k`` batches on each of ``N``
ranks the job has consumed the first ``k * N * batch_size`` samples; on ``M`` ranks each rank skips
``k * N / M`` batches to continue right after them (rounded down: at most ``N / M`` batches per rank are seen twice
when ``M`` does not divide ``k * N``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from lightning_resilience.checkpoint.data_position import EpochStart, ResumableBatchSampler

__all__ = ["LoaderCursor", "ResumableDataLoader", "drop_persistent_iterator", "is_map_style"]

log = logging.getLogger(__name__)


def is_map_style(loader: Any) -> bool:
    """A ``DataLoader`` over an indexable dataset: its order comes from a sampler a cursor can take over."""
    return isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset)


def _wrapped(obj: Any) -> list[Any]:
    """The samplers ``obj`` wraps: a batch sampler's ``sampler``, and the sampler that Lightning's
    ``DistributedSamplerWrapper`` keeps behind its ``dataset`` (an index dataset holding it as ``_sampler``)."""
    inner = [getattr(obj, "sampler", None), getattr(obj, "batch_sampler", None), getattr(obj, "_sampler", None)]
    dataset = getattr(obj, "dataset", None) if isinstance(obj, Sampler) else None
    if isinstance(getattr(dataset, "_sampler", None), Sampler):
        inner.append(dataset)
    return inner


def _generators(loader: DataLoader) -> list[torch.Generator]:
    """The loader's own generators its epoch order can draw from (the global one is captured separately): the
    loader's ``generator`` and those of its samplers and of the samplers they wrap (torchdata's ``RandomSampler``
    inside Lightning's ``DistributedSamplerWrapper``); datasets are not searched."""
    found: dict[int, torch.Generator] = {}
    seen: set[int] = set()
    todo: deque[Any] = deque([loader, loader.sampler, loader.batch_sampler])
    while todo:  # breadth first: the loader's and its samplers' generators come first, in this order
        obj = todo.popleft()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator) and gen.device.type == "cpu":
            found[id(gen)] = gen
        if obj is not loader:
            todo.extend(_wrapped(obj))
    return list(found.values())


def drop_persistent_iterator(loader: DataLoader) -> None:
    """Shut down the iterator a loader with persistent workers keeps between epochs; its next ``iter()`` starts anew."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        loader._iterator = None


class LoaderCursor:
    """Takes over one map-style DataLoader's index sampler and knows where its epoch stands.

    Args:
        loader: a ``DataLoader`` over a map-style dataset (after any sampler injection, e.g. Lightning's
            ``DistributedSampler``).
        salt: mixed into the per-batch worker seeds (e.g. the global rank).
    """

    def __init__(self, loader: DataLoader, salt: int = 0) -> None:
        if not is_map_style(loader):
            raise TypeError(f"a LoaderCursor needs a DataLoader over a map-style dataset, got {type(loader).__name__}")
        self.loader = loader
        batching = loader.batch_sampler is not None
        self._field = "batch_sampler" if batching else "sampler"
        self._original = getattr(loader, self._field)
        self.sampler = ResumableBatchSampler(
            self._original, _generators(loader), seeded=loader.num_workers > 0, salt=salt
        )
        # DataLoader refuses to change its sampler after construction; the loader object stays the user's own
        object.__setattr__(loader, self._field, self.sampler)
        drop_persistent_iterator(self.loader)  # it holds the index sampler it was created with

    @property
    def replicas(self) -> int:
        """Data-parallel ranks sharing the epoch (the ``DistributedSampler``'s ``num_replicas``, else 1)."""
        sampler = self.sampler.sampler if self.sampler.sampler is not None else self._original
        return int(getattr(sampler, "num_replicas", 1) or 1)

    @property
    def resuming(self) -> bool:
        """The next iteration continues a saved epoch."""
        return self.sampler.resume_position is not None

    def detach(self) -> None:
        """Give the loader its own index sampler back."""
        if getattr(self.loader, self._field) is self.sampler:
            object.__setattr__(self.loader, self._field, self._original)
            drop_persistent_iterator(self.loader)  # it holds the index sampler it was created with

    def state_dict(self, consumed: int, epoch_batches: int | None = None) -> dict[str, Any]:
        """The position after ``consumed`` batches of the current epoch (of ``epoch_batches``, default all); right
        after a load (an in-process rollback), the loaded epoch the next iteration continues."""
        epoch = self.sampler.open_epoch
        return {
            "epoch": None if epoch is None else epoch.state_dict(),
            "position": int(consumed),
            "length": int(len(self.loader) if epoch_batches is None else epoch_batches),
            "replicas": self.replicas,
            "skip": sorted(self.sampler.skip),
            "skip_next": sorted(self.sampler.skip_next),
        }

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Make the loader's next iteration continue the saved epoch; returns whether an epoch is open."""
        position = int(state.get("position", state.get("yielded", 0)))
        length = int(state.get("length") or len(self.loader))
        saved = int(state.get("replicas") or self.replicas)
        if saved != self.replicas:  # an elastic restart: continue after the samples the old ranks consumed
            remapped = position * saved // self.replicas
            log.info(
                "data position remapped from %d batches on %d ranks to %d batches on %d ranks",
                position,
                saved,
                remapped,
                self.replicas,
            )
            position, length = remapped, length * saved // self.replicas
        epoch = state.get("epoch")
        skip, skip_next = {int(k) for k in state.get("skip", ())}, {int(k) for k in state.get("skip_next", ())}
        self.sampler.skip = set()
        if epoch is None or not 0 <= position < min(length, len(self.loader)) - len(skip):
            self.sampler.skip_next = skip_next  # nothing open: the next iteration is a fresh epoch
            return False
        self.sampler.skip, self.sampler.skip_next = skip, skip_next
        self.sampler.resume_at(position, EpochStart.from_state(epoch))
        return True


class ResumableDataLoader(DataLoader):
    """A :class:`torch.utils.data.DataLoader` whose position inside an epoch can be saved and restored.

    :class:`~lightning_resilience.TieredCheckpoint` makes a plain ``DataLoader`` resumable by itself; this class is
    the same mechanism (a :class:`LoaderCursor`) for use without that callback: Lightning's fit loop saves and
    restores its ``state_dict`` like any stateful loader. The dataset must be map-style. Skipping on resume
    happens at the level of indices: nothing skipped is fetched.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._yielded = 0
        self._taken_over: LoaderCursor | None = None

    @property
    def _cursor(self) -> LoaderCursor:
        # taken over at first use, not at construction: under DDP Lightning first re-creates the loader from this
        # one's batch sampler (with its DistributedSampler), and it accepts only a plain BatchSampler there
        if self._taken_over is None:
            self._taken_over = LoaderCursor(self)
        return self._taken_over

    @property
    def replicas(self) -> int:
        """Data-parallel ranks sharing the epoch (the ``DistributedSampler``'s ``num_replicas``, else 1)."""
        return self._cursor.replicas

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        # a generator: the epoch starts at the first next(), after Lightning has set the sampler's epoch and, at
        # an epoch-end resume, after the checkpoint's RNG streams are back
        position = self._cursor.sampler.resume_position
        if position is not None:
            current = torch.get_rng_state()
            try:  # creating the iterator draws its base seed: the interrupted epoch drew it long ago
                inner = super().__iter__()
            finally:
                torch.set_rng_state(current)
        else:
            inner = super().__iter__()
        self._yielded = position or 0
        for batch in inner:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The epoch's start (generator states and worker seed) and the number of batches handed out in it."""
        return self._cursor.state_dict(self._yielded)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next ``iter()`` continue the saved epoch where it stopped."""
        self._cursor.load_state_dict(state_dict)
