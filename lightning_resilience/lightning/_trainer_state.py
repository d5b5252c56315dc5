"""The whole Trainer state as Lightning itself checkpoints it, captured and restored in-process.

Lightning has no public API to take its checkpoint dict without writing it, or to restore one after ``fit`` has
started; its checkpoint connector does both. All access to that private object is confined to this module, so a
Lightning upgrade touches one place (checked against Lightning 2.4 to 2.6).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer

__all__ = ["dump_trainer_state", "restore_trainer_state"]


def dump_trainer_state(trainer: Trainer) -> dict[str, Any]:
    """What ``Trainer.save_checkpoint`` would write: model, optimizers, schedulers, loops, callbacks, precision."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def restore_trainer_state(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """Apply a checkpoint dict during ``fit`` (after the strategy set up model and optimizers, before training).

    Same order as ``fit(ckpt_path=...)``: datamodule, model (with ``on_load_checkpoint``), callbacks, then
    precision plugin, loops, optimizers and schedulers.
    """
    connector = trainer._checkpoint_connector
    connector._loaded_checkpoint = checkpoint
    try:
        connector.restore_datamodule()
        connector.restore_model()
        connector.restore_callbacks()
        connector.restore_training_state()
    finally:
        connector._loaded_checkpoint = {}
