"""A DataLoader that remembers its position inside an epoch, so a resumed run sees exactly the same batches.

It implements the ``state_dict`` / ``load_state_dict`` protocol that Lightning's fit loop saves and restores for
stateful dataloaders. Exactness across the epoch boundary needs the shuffle order to be reproducible: the loader
records the global torch RNG state at the start of each epoch, and on resume replays the epoch start from it and
skips the batches already consumed, then puts the caller's RNG state back. No RNG draw is added or lost.

Elastic restarts: when the job comes back with another number of data-parallel ranks, the position is remapped.
A ``DistributedSampler`` deals the epoch's permutation out round-robin, so after ``k`` batches on each of ``N``
ranks the job has consumed the first ``k * N * batch_size`` samples; on ``M`` ranks each rank skips
``k * N / M`` batches to continue right after them (rounded down: at most ``N / M`` batches per rank are seen twice
when ``M`` does not divide ``k * N``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

__all__ = ["ResumableDataLoader"]

log = logging.getLogger(__name__)


class ResumableDataLoader(DataLoader):
    """Drop-in :class:`torch.utils.data.DataLoader` whose position inside an epoch can be saved and restored.

    The dataset must be map-style or otherwise sized (an unsized loader is prefetched by Lightning, so its count
    would run one batch ahead). Skipping on resume fetches the skipped batches, so worker-side randomness stays
    exact as well.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._yielded = 0
        self._epoch_rng: torch.Tensor | None = None
        self._first_rng: torch.Tensor | None = None
        self._resume: dict[str, Any] | None = None

    @property
    def replicas(self) -> int:
        """Data-parallel ranks sharing the epoch (the ``DistributedSampler``'s ``num_replicas``, else 1)."""
        return int(getattr(self.sampler, "num_replicas", 1) or 1)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        resume, self._resume = self._resume, None
        if resume is not None:
            yielded = int(resume["yielded"])
            saved = int(resume.get("replicas") or self.replicas)
            if saved != self.replicas:  # an elastic restart: continue after the samples the old ranks consumed
                remapped = yielded * saved // self.replicas
                log.info(
                    "data position remapped from %d batches on %d ranks to %d batches on %d ranks",
                    yielded,
                    saved,
                    remapped,
                    self.replicas,
                )
                yielded = remapped
            if resume["epoch_rng"] is not None and 0 < yielded < len(self):
                return self._resumed(resume["epoch_rng"], resume["first_rng"], yielded)
        return self._fresh()

    def _fresh(self) -> Iterator[Any]:
        # a generator too: resuming at an epoch's end, Lightning calls iter() for the next epoch before the RNG
        # streams are restored, so the epoch start (and the DataLoader's base-seed draw) waits for the first next()
        self._epoch_rng, self._first_rng, self._yielded = torch.get_rng_state(), None, 0
        yield from self._counting(super().__iter__())

    def _resumed(self, epoch_rng: torch.Tensor, first_rng: torch.Tensor | None, skip: int) -> Iterator[Any]:
        # a generator: nothing runs before the first next(), i.e. after Lightning has set the sampler's epoch
        current = torch.get_rng_state()
        try:
            torch.set_rng_state(epoch_rng)
            inner = super().__iter__()
            if first_rng is not None:
                torch.set_rng_state(first_rng)
            for _ in range(skip):  # replays the draws the interrupted epoch made
                next(inner)
        finally:
            torch.set_rng_state(current)
        self._epoch_rng, self._first_rng, self._yielded = epoch_rng, first_rng, skip
        yield from self._counting(inner)

    def _counting(self, inner: Iterator[Any]) -> Iterator[Any]:
        while True:
            if self._first_rng is None:  # samplers draw their shuffle seed lazily, at the first batch
                self._first_rng = torch.get_rng_state()
            try:
                batch = next(inner)
            except StopIteration:
                return
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """RNG states at the epoch's start and first batch, and the number of batches handed out this epoch."""
        return {
            "epoch_rng": None if self._epoch_rng is None else self._epoch_rng.clone(),
            "first_rng": None if self._first_rng is None else self._first_rng.clone(),
            "yielded": self._yielded,
            "replicas": self.replicas,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next ``iter()`` continue the saved epoch where it stopped."""

        def as_state(value: Any) -> torch.Tensor | None:
            return None if value is None else torch.as_tensor(value, dtype=torch.uint8).clone()

        self._resume = {
            "epoch_rng": as_state(state_dict.get("epoch_rng")),
            "first_rng": as_state(state_dict.get("first_rng")),
            "yielded": int(state_dict.get("yielded", 0)),
            "replicas": state_dict.get("replicas"),
        }
