"""The train data's position in a snapshot: Lightning's train loaders made resumable at batch level, whatever
loader the user built.

At train start (after the checkpoint's RNG streams are back) each train loader Lightning iterates is taken over
according to its kind, and its iterator is created anew, continuing the saved epoch at the next batch:

* a map-style loader, plain or torchdata's ``StatefulDataLoader``, gets a
  :class:`~lightning_resilience.checkpoint.dataloader.LoaderCursor` (order, sampler epoch and generators, per-batch
  worker seeds); a ``StatefulDataLoader``'s own state is superseded by it;
* a ``StatefulDataLoader`` over an iterable dataset keeps its own state, recorded in step with the batches training
  consumed (:class:`~lightning_resilience.checkpoint.stateful_position.StatefulPosition`); Lightning's copy of that
  state, a batch ahead, is superseded;
* another loader with ``state_dict`` / ``load_state_dict`` (``ResumableDataLoader``, the user's own) is left alone:
  Lightning saves its state with its loops;
* a loader over an iterable dataset without state cannot be made exact: one warning at fit start says so.

A loader whose Lightning-saved state we supersede is loaded with an empty state by Lightning (``load_state_dict({})``
leaves a ``StatefulDataLoader`` as it is), so nothing of the loader's own restore runs before ours.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import lightning
import torch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_resilience.checkpoint.data_position import raw_position
from lightning_resilience.checkpoint.dataloader import LoaderCursor, is_map_style
from lightning_resilience.checkpoint.rng import capture_rng_states, restore_rng_states
from lightning_resilience.checkpoint.stateful_position import StatefulPosition, is_stateful_dataloader
from lightning_resilience.lightning import _trainer_state
from lightning_resilience.lightning._trainer_state import (
    consumed_batches,
    epoch_batches,
    fetched_ahead,
    restart_train_iterator,
    rewind_fetcher,
    supersede_loader_states,
    train_loaders,
)

__all__ = ["TrainDataPosition"]

# Lightning warns on every mid-epoch resume whose loaders do not implement its stateful protocol; ours are exact
_NOT_RESUMABLE = r"You're resuming from a checkpoint that ended before the epoch ended"
# what a loader's entry says of the state Lightning saves for it with its loops (absent: Lightning saves none)
_LIGHTNING_STATE = "lightning_state"
_SUPERSEDED, _KEPT = "superseded", "kept"


def _describe(index: int, loader: Any) -> str:
    dataset = getattr(loader, "dataset", None)
    over = f" over {type(dataset).__name__}" if dataset is not None else ""
    return f"train dataloader {index} ({type(loader).__name__}{over})"


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class TrainDataPosition:
    """Saves and restores the position of a Trainer's train loaders inside their epoch."""

    def __init__(self) -> None:
        self._cursors: list[LoaderCursor | None] = []
        self._positions: list[StatefulPosition | None] = []
        self._kept: list[bool] = []
        """Per loader: left alone with a state of its own, which Lightning saves and restores."""
        self._pending: list[dict[str, Any] | None] | None = None
        self._trainer: Trainer | None = None

    def load_state_dict(self, state: list[dict[str, Any] | None] | None) -> None:
        """Keep a saved position until :meth:`attach` applies it."""
        self._pending = state

    def state_dict(self) -> list[dict[str, Any] | None] | None:
        """Each train loader's position after the batches training consumed (None for a loader left alone, a marker
        for one left alone with a state of its own)."""
        if self._trainer is None:
            return self._pending
        trainer = self._trainer
        consumed, per_epoch, epoch = consumed_batches(trainer), epoch_batches(trainer), trainer.current_epoch
        out: list[dict[str, Any] | None] = []
        for cursor, position, kept in zip(self._cursors, self._positions, self._kept):
            entry: dict[str, Any] | None = None
            if cursor is not None:
                entry = cursor.state_dict(_cycled(consumed, len(cursor.loader)), per_epoch)
                loader = cursor.loader
            elif position is not None:
                entry, loader = position.state_dict(epoch, consumed), position.loader
            if entry is not None and isinstance(loader, _Stateful):
                entry[_LIGHTNING_STATE] = _SUPERSEDED
            out.append({_LIGHTNING_STATE: _KEPT} if kept else entry)
        return out

    @staticmethod
    def supersede(checkpoint: dict[str, Any], state: list[dict[str, Any] | None] | None) -> None:
        """Have Lightning restore nothing of the loaders whose position ``state`` (this callback's data state in
        ``checkpoint``) restores: their own state, saved with Lightning's loops, is replaced by an empty one."""
        if not state:
            return
        stateful = [s for s in state if s is not None and s.get(_LIGHTNING_STATE) in (_SUPERSEDED, _KEPT)]
        supersede_loader_states(checkpoint, [s[_LIGHTNING_STATE] == _SUPERSEDED for s in stateful])

    def attach(self, trainer: Trainer) -> None:
        """Take over the train loaders and continue the saved position (call once the RNG is restored)."""
        self.detach()
        loaders = train_loaders(trainer)
        if not loaders:
            return
        self._trainer = trainer
        for i, dl in enumerate(loaders):
            cursor, position = self._take(i, dl, trainer.global_rank)
            self._cursors.append(cursor)
            self._positions.append(position)
            self._kept.append(cursor is None and position is None and isinstance(dl, _Stateful))
        pending, self._pending = self._pending, None
        if pending is not None and len(pending) != len(loaders):
            rank_zero_warn(
                f"the checkpoint holds the positions of {len(pending)} train dataloaders, this run has "
                f"{len(loaders)}: every loader starts its epoch from the beginning"
            )
            pending = None
        epoch = trainer.current_epoch
        ours, at_epoch_end = [], set()
        for i, (cursor, position) in enumerate(zip(self._cursors, self._positions)):
            state = None if pending is None else pending[i]
            if cursor is not None:
                ours.append(i)
                if state is not None and state.get("kind") is None and not cursor.load_state_dict(state):
                    at_epoch_end.add(i)
            elif position is not None:
                if state is not None and state.get("kind") == "stateful" and position.load_state_dict(state, epoch):
                    ours.append(i)
                else:
                    position.start_epoch(epoch)
        if at_epoch_end and not _trainer_state.RESUMES_EPOCH_ENDS:
            rank_zero_warn(
                f"this resume may not be exact: the snapshot was taken at the last batch of an epoch, which Lightning "
                f"{lightning.__version__} (before 2.5) restarts inside that epoch: unless a validation runs there, it "
                "trains the next epoch's first batch as that epoch's last one, then starts another epoch. Lightning "
                "2.5 and later resume it exactly; a snapshot inside an epoch resumes exactly on every version."
            )
        # Creating an iterator draws the DataLoader's base seed from the global RNG. Lightning's setup_data has
        # already made that draw for this epoch, or the interrupted run made it long before the snapshot: the new
        # iterator draws under a fork. After a snapshot at an epoch's end the next epoch's iterator is new in the
        # uninterrupted run too, and Lightning does not create it again: that draw is made here.
        ends = {id(loaders[i]) for i in at_epoch_end}
        resuming = {id(p.loader): p for p in self._positions if p is not None and p.resuming}

        def create(dl: Any) -> Any:
            position = resuming.get(id(dl))
            if position is None:
                return iter(dl) if id(dl) in ends else _iter_keeping_rng(dl)
            with _rng_forked(), position.resumed(epoch):
                return iter(dl)

        @contextmanager
        def fetching_ahead() -> Iterator[None]:
            # the fetcher creates every iterator and fetches the next batch: the interrupted run fetched it before
            # the snapshot, so its draws are forked too (unless an epoch starts here)
            with ExitStack() as stack:
                if resuming or not ends:
                    stack.enter_context(_rng_forked())
                for position in resuming.values():
                    stack.enter_context(position.resumed(epoch))
                yield

        restart_train_iterator(trainer, ours, create, fetching_ahead)
        self.record(trainer)  # the next batch is fetched from here: a checkpoint after it continues from this state
        taken = zip(self._cursors, self._positions, loaders)
        if all(c is not None or p is not None or isinstance(dl, _Stateful) for c, p, dl in taken):
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)

    def record(self, trainer: Trainer) -> None:
        """Whenever the next train batch fetched is the next one drawn in this process (after a batch, after
        validation): the state of each stateful iterable loader, with the batches it handed out."""
        if any(p is not None for p in self._positions):
            handed, epoch = consumed_batches(trainer) + fetched_ahead(trainer), trainer.current_epoch
            for position in self._positions:
                if position is not None:
                    position.record(epoch, handed)

    def start_epoch(self, trainer: Trainer) -> None:
        """At an epoch's start (before its iterator is created)."""
        for position in self._positions:
            if position is not None:
                position.start_epoch(trainer.current_epoch)

    def rewind(self, trainer: Trainer, skip_ahead: int | None) -> list[Any]:
        """In-process rollback: continue from the loaded position (:meth:`load_state_dict`) right now, leaving out the
        batch handed out ``skip_ahead`` batches after it (None: leave nothing out). Returns, per loader, the indices
        of that batch (None where not known: a loader left alone, or a batch of another epoch than the running one;
        a loader over an iterable dataset leaves nothing out)."""
        state, self._pending = self._pending, None
        skipped: list[Any] = [None] * len(self._cursors)
        if state is not None and skip_ahead is not None and len(state) == len(self._cursors):
            state = [dict(s) if s is not None else None for s in state]
            for i, (cursor, saved) in enumerate(zip(self._cursors, state)):
                if cursor is not None and saved is not None and saved.get("kind") is None:
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
        self._cursors, self._positions, self._kept, self._trainer = [], [], [], None

    @staticmethod
    def _take(index: int, loader: Any, rank: int) -> tuple[LoaderCursor | None, StatefulPosition | None]:
        stateful_loader = is_stateful_dataloader(loader)
        if is_map_style(loader) and (stateful_loader or not isinstance(loader, _Stateful)):
            if stateful_loader and _has_state(loader.dataset):
                rank_zero_warn(
                    f"{_describe(index, loader)}: its dataset has a state_dict of its own, which a resume does not "
                    "restore (the position in the epoch, order and random draws are restored)"
                )
            return LoaderCursor(loader, salt=rank), None
        if stateful_loader:
            if loader.num_workers > 0:
                rank_zero_warn(
                    f"{_describe(index, loader)} resumes the order of its samples exactly, but not the random "
                    "numbers drawn in its worker processes (their generators start anew at a resume): a dataset "
                    "that draws while loading (random crops, masking) draws other values after a resume. Draws "
                    "in the main process (num_workers=0) are restored."
                )
            return None, StatefulPosition(loader)
        if isinstance(loader, _Stateful):
            rank_zero_info(f"{_describe(index, loader)} resumes by its own state_dict, saved with Lightning's loops")
            return None, None
        dataset = getattr(loader, "dataset", None)
        why = (
            "its dataset has a state_dict, but this loader does not save it (with workers the state lives in them)"
            if _has_state(dataset)
            else "it iterates a dataset without indices or state_dict/load_state_dict"
        )
        rank_zero_warn(
            f"{_describe(index, loader)} is not resumable inside an epoch: {why}. A resume restarts its epoch from "
            "the beginning (samples seen again; order and worker randomness differ from an uninterrupted run). For "
            "an exact resume use a map-style dataset, or torchdata's StatefulDataLoader over a dataset with "
            "state_dict/load_state_dict."
        )
        return None, None


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


@contextmanager
def _rng_forked() -> Iterator[None]:
    """The global generators (Python's, NumPy's, torch's) as they were, on exit."""
    current = capture_rng_states()
    try:
        yield
    finally:
        restore_rng_states(current)


def _iter_keeping_rng(loader: Any) -> Any:
    current = torch.get_rng_state()  # the only draw of an iterator's creation: its base seed
    try:
        return iter(loader)
    finally:
        torch.set_rng_state(current)


def _cycled(consumed: int, length: int) -> int:
    """A loader shorter than the epoch restarts when exhausted (``max_size_cycle``): its position in this cycle."""
    return consumed if consumed <= length or length == 0 else (consumed - 1) % length + 1
