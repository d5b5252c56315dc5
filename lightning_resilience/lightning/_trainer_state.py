"""The whole Trainer state as Lightning itself checkpoints it, captured and restored in-process.

Lightning has no public API to take its checkpoint dict without writing it, or to restore one after ``fit`` has
started; its checkpoint connector does both. All access to that private object is confined to this module, so a
Lightning upgrade touches one place (checked against Lightning 2.4 to 2.6).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning
from lightning.fabric.utilities.data import _set_sampler_epoch, sized_len
from lightning.pytorch import Trainer
from lightning.pytorch.loops.loop import _Loop

# Lightning 2.5 learned to restart from a checkpoint taken in ``on_train_batch_end``; earlier versions (NeMo pins 2.4)
# restart such a batch as if it had not been consumed
_LIGHTNING_BEFORE_2_5 = tuple(int(p) for p in lightning.__version__.split(".")[:2]) < (2, 5)
RESUMES_EPOCH_ENDS = not _LIGHTNING_BEFORE_2_5
"""Lightning resumes a checkpoint taken at an epoch's last batch at the next epoch (from 2.5 on; 2.4 trains the next
epoch's first batch as the old epoch's last one)."""

__all__ = [
    "RESUMES_EPOCH_ENDS",
    "callback_state",
    "consumed_batches",
    "discard_pending_checkpoint",
    "dump_trainer_state",
    "epoch_batches",
    "fetched_ahead",
    "pending_checkpoint_step",
    "restart_train_iterator",
    "restore_trainer_state",
    "rewind_fetcher",
    "supersede_loader_states",
    "train_loaders",
]


def dump_trainer_state(trainer: Trainer) -> dict[str, Any]:
    """What ``Trainer.save_checkpoint`` would write: model, optimizers, schedulers, loops, callbacks, precision."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def restore_trainer_state(trainer: Trainer, checkpoint: dict[str, Any], *, in_flight: bool = False) -> None:
    """Apply a checkpoint dict during ``fit`` (after the strategy set up model and optimizers, before training).

    Same order as ``fit(ckpt_path=...)``: datamodule, model (with ``on_load_checkpoint``), callbacks, then
    precision plugin, loops, optimizers and schedulers.

    ``in_flight``: applied from ``on_train_batch_end`` while the loops run (an in-process rollback to a snapshot
    also taken in ``on_train_batch_end``): the loops go on as they do after that hook, so the restored progress is
    taken as it is and the loops are not marked as restarting.
    """
    connector = trainer._checkpoint_connector
    bump = _LIGHTNING_BEFORE_2_5 and not in_flight
    connector._loaded_checkpoint = _batch_completed(checkpoint) if bump else checkpoint
    flags = _loop_flags(trainer.fit_loop) if in_flight else []
    try:
        connector.restore_datamodule()
        connector.restore_model()
        connector.restore_callbacks()
        connector.restore_training_state()
    finally:
        connector._loaded_checkpoint = {}
        for loop, saved in flags:
            loop.__dict__.update(saved)


_LOOP_FLAGS = ("_restarting", "_loaded_from_state_dict", "_resuming_from_checkpoint")


def _loop_flags(loop: Any) -> list[tuple[Any, dict[str, Any]]]:
    """Each loop under ``loop`` with its restart flags (what ``load_state_dict`` sets)."""
    out = [(loop, {k: loop.__dict__[k] for k in _LOOP_FLAGS if k in loop.__dict__})]
    for child in list(loop.__dict__.values()):
        if isinstance(child, _Loop):
            out.extend(_loop_flags(child))
    return out


def rewind_fetcher(trainer: Trainer, consumed: int) -> None:
    """After an in-process rollback restarted the train iterator: the fetcher has handed out ``consumed`` batches
    of an epoch whose length (the loaders' lengths, quarantined batches left out) may have changed."""
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is None or fetcher._combined_loader is None:
        return
    fetcher.fetched = consumed
    fetcher.length = sized_len(fetcher.combined_loader)
    fetcher.done = fetcher.length is not None and consumed >= fetcher.length and not getattr(fetcher, "batches", None)


def pending_checkpoint_step(trainer: Trainer) -> int | None:
    """The step of the checkpoint ``fit(ckpt_path=...)`` loaded, whose optimizer and loop state Lightning applies
    right after ``on_fit_start`` (None: nothing loaded yet, e.g. strategies that restore after setup)."""
    loaded = trainer._checkpoint_connector._loaded_checkpoint
    return int(loaded["global_step"]) if loaded and "global_step" in loaded else None


def discard_pending_checkpoint(trainer: Trainer) -> None:
    """Lightning will not apply the rest of the ``ckpt_path`` checkpoint (a newer state was restored instead)."""
    trainer._checkpoint_connector._loaded_checkpoint = {}


def _batch_completed(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with the batch its snapshot was taken in (``on_train_batch_end``) counted as completed.

    Lightning < 2.5 resets the batch progress to its ``completed`` count on restart, one short for such a
    snapshot: it would count the consumed batch again (off-by-one ``batch_idx``, accumulation boundaries, epoch end).
    """
    fit = checkpoint.get("loops", {}).get("fit_loop")
    progress = None if fit is None else fit.get("epoch_loop.batch_progress")
    if progress is None or any(progress[k]["completed"] != progress[k]["processed"] - 1 for k in ("total", "current")):
        return checkpoint
    bumped = {k: {**progress[k], "completed": progress[k]["processed"]} for k in ("total", "current")}
    loops = {**checkpoint["loops"], "fit_loop": {**fit, "epoch_loop.batch_progress": {**progress, **bumped}}}
    return {**checkpoint, "loops": loops}


def train_loaders(trainer: Trainer) -> list[Any]:
    """The train dataloaders as the fit loop iterates them (after Lightning injected its sampler); [] before."""
    combined = trainer.fit_loop._combined_loader
    return [] if combined is None else list(combined.flattened)


def restart_train_iterator(
    trainer: Trainer,
    indices: list[int],
    create: Callable[[Any], Any] = iter,
    fetching_ahead: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> None:
    """Create the iterators of train loaders ``indices`` anew with ``create`` (their samplers changed after
    ``setup_data``, which creates the train iterator before any callback hook can act).

    Only the named loaders' iterators are replaced, so a stateful loader that already loaded its position keeps it;
    when the fetcher fetches ahead (loaders without a length) the whole iterator is created anew inside
    ``fetching_ahead()``, as its epoch start does, with the batch it fetches ahead.
    """
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is None or not indices:
        return
    combined = fetcher.combined_loader
    # the fit loop sets the samplers' epoch only after this hook; an iterator with workers draws its first indices
    # when it is created, so a DistributedSampler must know its epoch now (the value the fit loop will set)
    epoch = trainer.fit_loop.epoch_progress.current.processed  # type: ignore[attr-defined]
    for loader in combined.flattened:
        _set_sampler_epoch(loader, epoch)
    mode_iterator = combined._iterator
    if mode_iterator is None or getattr(fetcher, "batches", None):
        combined.reset()  # shuts the old iterators' workers down first
        with fetching_ahead():
            iter(fetcher)
        return
    for i in indices:
        mode_iterator.iterators[i] = create(combined.flattened[i])  # the old one shuts its workers down when dropped


def fetched_ahead(trainer: Trainer) -> int:
    """Batches the train fetcher has taken from the loaders beyond those handed to training (it fetches one ahead
    for loaders without a length, to know the last batch in advance)."""
    fetcher = trainer.fit_loop._data_fetcher
    return len(getattr(fetcher, "batches", None) or ())


def supersede_loader_states(checkpoint: dict[str, Any], superseded: list[bool]) -> None:
    """In a checkpoint about to be restored: Lightning restores an empty state into the stateful train loaders marked
    in ``superseded`` (one flag per loader whose state Lightning saved with its loops, in order); the checkpoint's own
    objects are left as they are."""
    loops = checkpoint.get("loops") or {}
    fit = loops.get("fit_loop") or {}
    saved = fit.get("state_dict") or {}
    states = saved.get("combined_loader")
    if not states or len(states) != len(superseded) or not any(superseded):
        return
    emptied = [{} if drop else state for state, drop in zip(states, superseded)]
    checkpoint["loops"] = {**loops, "fit_loop": {**fit, "state_dict": {**saved, "combined_loader": emptied}}}


def callback_state(checkpoint: dict[str, Any], state_key: str) -> dict[str, Any] | None:
    """The state a callback saved in ``checkpoint`` (None if it saved none)."""
    state = (checkpoint.get("callbacks") or {}).get(state_key)
    return state if isinstance(state, dict) else None


def consumed_batches(trainer: Trainer) -> int:
    """Batches of the current epoch that training has consumed (the batch progress Lightning restores with its
    loops): not what the iterator handed out, which for loaders without a length runs one batch ahead."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def epoch_batches(trainer: Trainer) -> int | None:
    """Batches an epoch of training takes (``limit_train_batches`` applied); None when unknown."""
    n = trainer.num_training_batches
    return None if n == float("inf") else int(n)
