"""Fault drills of the recipes: a ``drill`` from ``configs/drill/`` injects one fault at a chosen (rank, step,
attempt) so a user can rehearse recovery. The resilience callbacks themselves come from the suite's one builder,
:func:`lightning_resilience.lightning.suite.build_suite`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from omegaconf import DictConfig

from lightning_resilience.ft.restart import current_attempt

__all__ = ["DRILLS", "FaultDrill", "attempt_number", "drill_callbacks"]

DRILLS = ("none", "kill_rank", "crash", "hang", "preempt", "slow_rank", "bit_flip")
HANG_LIMIT_S = 3600.0  # a drilled hang ends by itself after this long if nothing detects it


def attempt_number() -> int:
    """This attempt's index: torchrun's restart count, or the attempt of ``lightning-resilience launch``."""
    return current_attempt().restart_count


class FaultDrill(Callback):
    """Injects the drill's fault at a chosen (rank, step, attempt) so a user can rehearse recovery."""

    def __init__(
        self, kind: str, rank: int = 0, step: int = 35, attempt: int = 0, factor: float = 2.0, where: str = "compute"
    ) -> None:
        if kind not in DRILLS:
            raise ValueError(f"drill.kind must be one of {DRILLS}, got {kind!r}")
        if factor <= 1.0:
            raise ValueError(f"drill.factor must be > 1, got {factor}")
        if where not in ("compute", "data"):
            raise ValueError(f"drill.where must be 'compute' or 'data', got {where!r}")
        self.kind, self.rank, self.step, self.attempt, self.factor = kind, rank, step, attempt, factor
        self.where = where
        self._t0 = 0.0
        self._last_step_s = 0.0

    def _armed(self, trainer: Trainer) -> bool:
        return trainer.global_rank == self.rank and attempt_number() == self.attempt

    def _slowed(self, trainer: Trainer, where: str) -> bool:
        return (
            self.kind == "slow_rank"
            and self.where == where
            and self._armed(trainer)
            and trainer.global_step > self.step
        )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._slowed(trainer, "data"):
            # a slow data path: the batch arrives late (this callback runs before the detectors: the wait falls
            # between their steps, where the wait for data is timed)
            threading.Event().wait((self.factor - 1.0) * self._last_step_s)
        self._t0 = time.perf_counter()
        # step `step` is done (the checkpoint callback, which runs last, included): the fault hits as the next starts
        if self.kind in ("none", "slow_rank", "bit_flip") or trainer.global_step != self.step:
            return
        if not self._armed(trainer):
            return
        print(f"[drill] rank {self.rank}: injecting {self.kind} after step {self.step}", flush=True)
        if self.kind == "kill_rank":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "crash":
            raise RuntimeError(f"drill: injected crash at step {self.step}")
        elif self.kind == "preempt":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.kind == "hang":
            threading.Event().wait(HANG_LIMIT_S)  # the watchdog (resilience/ft) must notice and end this rank

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._last_step_s = time.perf_counter() - self._t0
        if self._slowed(trainer, "compute"):
            # a fail-slow device: this rank's steps take `factor` times as long from `step` on (this callback runs
            # before the detectors, so the wait is inside the step they time)
            threading.Event().wait((self.factor - 1.0) * self._last_step_s)


def drill_callbacks(drill: DictConfig) -> list[Callback]:
    """The drill's callbacks: a :class:`FaultDrill`, or a bit-flip injector for ``bit_flip``."""
    kind = str(drill.kind)
    if kind == "bit_flip":
        from lightning_resilience.sdc.inject import FlipSpec

        _ReportFlips = _flip_injection()

        if attempt_number() != int(drill.get("attempt", 0)):
            return []
        spec = FlipSpec(
            location=str(drill.location),  # type: ignore[arg-type]  # FlipSpec checks the value
            step=int(drill.step),
            rank=int(drill.rank),
            bit_class=str(drill.bit_class),  # type: ignore[arg-type]
            bit=None if drill.get("bit") is None else int(drill.bit),
            seed=int(drill.seed),
        )
        return [_ReportFlips([spec])]
    keys = ("rank", "step", "attempt", "factor", "where")
    return [FaultDrill(kind, **{k: drill[k] for k in keys if k in drill})]


def _flip_injection() -> type:
    from lightning_resilience.lightning.callbacks.sdc_inject import BitFlipInjection

    class ReportFlips(BitFlipInjection):  # type: ignore[misc]
        """Says what it flipped, so the drill's output shows the fault next to its detection."""

        def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            for record in self.records:
                print(f"[drill] injected {record}", flush=True)

    return ReportFlips
