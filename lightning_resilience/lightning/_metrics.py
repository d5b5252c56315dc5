"""How our callbacks log: host values, straight to the trainer's loggers, at Lightning's logging cadence.

``LightningModule.log`` turns every Python float into a tensor on the module's device (a host-to-device copy that
waits for the device on a GPU) and reads it back when the loggers write. Our figures are host values already, so
they skip that round trip and go to ``trainer.loggers`` directly, every ``trainer.log_every_n_steps`` optimizer
steps (or when something happened that must not wait for the next logging step).
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning.pytorch import Trainer

__all__ = ["log_host_metrics", "logging_step"]


def logging_step(trainer: Trainer) -> bool:
    """Whether this step boundary is one at which our callbacks log (a logger is attached and ``global_step`` is a
    multiple of ``trainer.log_every_n_steps``)."""
    every = int(trainer.log_every_n_steps)  # type: ignore[attr-defined]  # set by Lightning's logger connector
    return bool(trainer.loggers) and every > 0 and trainer.global_step % every == 0


def log_host_metrics(trainer: Trainer, metrics: Mapping[str, float]) -> None:
    """Write ``metrics`` (host numbers) to every logger of ``trainer`` at the current step. No device tensor is made
    and nothing is reduced across ranks: the loggers write on global rank 0 only, as for ``self.log(...,
    sync_dist=False)``."""
    if not metrics:
        return
    values = {name: float(value) for name, value in metrics.items()}
    for logger in trainer.loggers:
        logger.log_metrics(values, step=trainer.global_step)
