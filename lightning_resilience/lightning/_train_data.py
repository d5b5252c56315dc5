"""The train data's position in a snapshot: Lightning's train loaders made resumable at batch level, whatever
loader the user built.

At train start (after the checkpoint's RNG streams are back) every map-style train loader Lightning iterates gets a
:class:`~lightning_resilience.checkpoint.dataloader.LoaderCursor`, and its iterator is created anew, continuing the
saved epoch at the next batch. Stateful loaders (torchdata's ``StatefulDataLoader``, ``ResumableDataLoader``, any
loader with ``state_dict`` / ``load_state_dict``) are left alone: Lightning saves their state with its loops. A
loader over an iterable dataset cannot be made exact this way: one warning at fit start says so.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lightning_resilience.checkpoint.data_position import raw_position
from lightning_resilience.checkpoint.dataloader import LoaderCursor, is_map_style
from lightning_resilience.lightning._trainer_state import (
    consumed_batches,
    epoch_batches,
    restart_train_iterator,
    rewind_fetcher,
    train_loaders,
)

__all__ = ["TrainDataPosition"]

# Lightning warns on every mid-epoch resume whose loaders do not implement its stateful protocol; ours are exact
_NOT_RESUMABLE = r"You're resuming from a checkpoint that ended before the epoch ended"


def _describe(index: int, loader: Any) -> str:
    dataset = getattr(loader, "dataset", None)
    over = f" over {type(dataset).__name__}" if dataset is not None else ""
    return f"train dataloader {index} ({type(loader).__name__}{over})"


class TrainDataPosition:
    """Saves and restores the position of a Trainer's train loaders inside their epoch."""

    def __init__(self) -> None:
        self._cursors: list[LoaderCursor | None] = []
        self._pending: list[dict[str, Any] | None] | None = None
        self._trainer: Trainer | None = None

    def load_state_dict(self, state: list[dict[str, Any] | None] | None) -> None:
        """Keep a saved position until :meth:`attach` applies it."""
        self._pending = state

    def state_dict(self) -> list[dict[str, Any] | None] | None:
        """Each train loader's position after the batches training consumed (None for loaders left alone)."""
        if self._trainer is None:
            return self._pending
        consumed, per_epoch = consumed_batches(self._trainer), epoch_batches(self._trainer)
        return [
            None if cursor is None else cursor.state_dict(_cycled(consumed, len(cursor.loader)), per_epoch)
            for cursor in self._cursors
        ]

    def attach(self, trainer: Trainer) -> None:
        """Take over the map-style train loaders and continue the saved position (call once the RNG is restored)."""
        self.detach()
        loaders = train_loaders(trainer)
        if not loaders:
            return
        self._trainer = trainer
        self._cursors = [self._cursor(i, dl, trainer.global_rank) for i, dl in enumerate(loaders)]
        pending, self._pending = self._pending, None
        if pending is not None and len(pending) != len(loaders):
            rank_zero_warn(
                f"the checkpoint holds the positions of {len(pending)} train dataloaders, this run has "
                f"{len(loaders)}: every loader starts its epoch from the beginning"
            )
            pending = None
        ours = [i for i, cursor in enumerate(self._cursors) if cursor is not None]
        at_epoch_end = set()
        for i in ours:
            state = None if pending is None else pending[i]
            cursor = self._cursors[i]
            assert cursor is not None
            if state is not None and not cursor.load_state_dict(state):
                at_epoch_end.add(i)
        # Creating an iterator draws the DataLoader's base seed from the global RNG. Lightning's setup_data has
        # already made that draw for this epoch, or the interrupted run made it long before the snapshot: the new
        # iterator draws under a fork. After a snapshot at an epoch's end the next epoch's iterator is new in the
        # uninterrupted run too, and Lightning does not create it again: that draw is made here.
        ends = {id(loaders[i]) for i in at_epoch_end}
        restart_train_iterator(trainer, ours, lambda dl: iter(dl) if id(dl) in ends else _iter_keeping_rng(dl))
        if all(cursor is not None or isinstance(dl, _Stateful) for cursor, dl in zip(self._cursors, loaders)):
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)

    def rewind(self, trainer: Trainer, skip_ahead: int | None) -> list[Any]:
        """In-process rollback: continue from the loaded position (:meth:`load_state_dict`) right now, leaving out the
        batch handed out ``skip_ahead`` batches after it (None: leave nothing out). Returns, per loader, the indices
        of that batch (None where not known: a loader left alone, or a batch of another epoch than the running one)."""
        state, self._pending = self._pending, None
        skipped: list[Any] = [None] * len(self._cursors)
        if state is not None and skip_ahead is not None and len(state) == len(self._cursors):
            state = [dict(s) if s is not None else None for s in state]
            for i, (cursor, saved) in enumerate(zip(self._cursors, state)):
                if cursor is not None and saved is not None:
                    skipped[i] = _quarantine(cursor, saved, skip_ahead)
        self.load_state_dict(state)
        self.attach(trainer)
        rewind_fetcher(trainer, consumed_batches(trainer))
        return skipped

    def detach(self) -> None:
        """Give every loader its own sampler back (end of fit)."""
        for cursor in self._cursors:
            if cursor is not None:
                cursor.detach()
        self._cursors, self._trainer = [], None

    @staticmethod
    def _cursor(index: int, loader: Any, rank: int) -> LoaderCursor | None:
        if isinstance(loader, _Stateful):
            return None  # its own state_dict travels in Lightning's loop state
        if is_map_style(loader):
            return LoaderCursor(loader, salt=rank)
        dataset = getattr(loader, "dataset", None)
        why = (
            "its dataset has a state_dict, but this loader does not save it (with workers the state lives in them)"
            if callable(getattr(dataset, "state_dict", None))
            else "it iterates a dataset without indices or state_dict/load_state_dict"
        )
        rank_zero_warn(
            f"{_describe(index, loader)} is not resumable inside an epoch: {why}. A resume restarts its epoch from "
            "the beginning (samples seen again; order and worker randomness differ from an uninterrupted run). For "
            "an exact resume use a map-style dataset, or torchdata's StatefulDataLoader over a dataset with "
            "state_dict/load_state_dict."
        )
        return None


def _quarantine(cursor: LoaderCursor, saved: dict[str, Any], ahead: int) -> Any:
    """Add the batch ``ahead`` batches after the saved position to the saved skip lists; its indices if known."""
    skip, skip_next = set(saved.get("skip", ())), set(saved.get("skip_next", ()))
    length = int(saved.get("length") or len(cursor.loader))
    open_epoch = saved.get("epoch") is not None and int(saved["position"]) < length - len(skip)
    handed = (int(saved["position"]) if open_epoch else 0) + ahead
    if open_epoch and handed < length - len(skip):
        raw, current = raw_position(handed, skip), True
        skip.add(raw)
    else:
        handed -= length - len(skip) if open_epoch else 0
        raw, current = raw_position(handed, skip_next), False
        skip_next.add(raw)
    saved.update(skip=sorted(skip), skip_next=sorted(skip_next))
    running = cursor.sampler.epoch
    same_epoch = current and open_epoch and running is not None and str(running.seed) == str(saved["epoch"]["seed"])
    batch = cursor.sampler.recent.get(raw) if same_epoch else None
    return None if batch is None else [int(i) for i in batch] if isinstance(batch, list) else batch


def _iter_keeping_rng(loader: Any) -> Any:
    current = torch.get_rng_state()
    try:
        return iter(loader)
    finally:
        torch.set_rng_state(current)


def _cycled(consumed: int, length: int) -> int:
    """A loader shorter than the epoch restarts when exhausted (``max_size_cycle``): its position in this cycle."""
    return consumed if consumed <= length or length == 0 else (consumed - 1) % length + 1
