"""A DataLoader that remembers its position inside an epoch, so a resumed run sees exactly the same batches.

It implements the ``state_dict`` / ``load_state_dict`` protocol that Lightning's fit loop saves and restores for
stateful dataloaders. Exactness across the epoch boundary needs the shuffle order to be reproducible: the loader
records the global torch RNG state at the start of each epoch, and on resume replays the epoch start from it and
skips the batches already consumed, then puts the caller's RNG state back. No RNG draw is added or lost.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

__all__ = ["ResumableDataLoader"]


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
        self._resume: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        resume, self._resume = self._resume, None
        if resume is not None and resume["epoch_rng"] is not None and 0 < resume["yielded"] < len(self):
            return self._resumed_iter(resume["epoch_rng"], int(resume["yielded"]))
        self._epoch_rng = torch.get_rng_state()
        self._yielded = 0
        return self._counting(super().__iter__())

    def _resumed_iter(self, epoch_rng: torch.Tensor, skip: int) -> Iterator[Any]:
        current = torch.get_rng_state()
        torch.set_rng_state(epoch_rng)
        try:
            inner = super().__iter__()
            for _ in range(skip):  # replays the draws the interrupted epoch made
                next(inner)
        finally:
            torch.set_rng_state(current)
        self._epoch_rng = epoch_rng.clone()
        self._yielded = skip
        return self._counting(inner)

    def _counting(self, inner: Iterator[Any]) -> Iterator[Any]:
        for batch in inner:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Epoch-start RNG state and the number of batches handed out in the current epoch."""
        return {"epoch_rng": None if self._epoch_rng is None else self._epoch_rng.clone(), "yielded": self._yielded}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next ``iter()`` continue the saved epoch where it stopped."""
        rng = state_dict.get("epoch_rng")
        self._resume = {
            "epoch_rng": None if rng is None else torch.as_tensor(rng, dtype=torch.uint8).clone(),
            "yielded": int(state_dict.get("yielded", 0)),
        }
