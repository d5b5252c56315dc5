"""BitFlipInjection: drive planned bit flips (and a faulty device) from a recipe, for SDC drills and tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_resilience.sdc.inject import BitClass, BitFlipInjector, FlipRecord, FlipSpec, Location

__all__ = ["BitFlipInjection"]


class BitFlipInjection(Callback):
    """Flip planned bits at planned (rank, step) pairs; optionally make one rank a faulty device.

    Parameter and optimizer-state flips happen at the start of the batch of ``spec.step`` (``trainer.global_step``
    optimizer steps done); gradient and activation flips are armed there and fire during that batch's backward or
    forward.

    Args:
        plan: the flips.
        faulty_rank: a rank whose ``faulty_location`` results are corrupted every ``faulty_every_k`` calls.
        faulty_location: 'grad' or 'activation'.
        faulty_every_k: corrupt every k-th result.
        faulty_bit_class: which bits the faulty device flips.
        faulty_target: the parameter (grad) or module (activation) name; None: chosen from the seed.
        faulty_rate: probability that each of those results is corrupted (1: every one; a flaky device below).
        faulty_bits: adjacent bits flipped in each corrupted element (a multi-bit burst).
        faulty_elements: elements corrupted per result, ``faulty_stride`` apart.
        faulty_stride: distance between two corrupted elements.
    """

    def __init__(
        self,
        plan: Sequence[FlipSpec] = (),
        *,
        faulty_rank: int | None = None,
        faulty_location: Location = "grad",
        faulty_every_k: int = 1,
        faulty_bit_class: BitClass = "exponent",
        faulty_target: str | None = None,
        faulty_rate: float = 1.0,
        faulty_bits: int = 1,
        faulty_elements: int = 1,
        faulty_stride: int = 1,
    ) -> None:
        if not 0.0 < faulty_rate <= 1.0:
            raise ValueError(f"inject.faulty_rate must be in (0, 1], got {faulty_rate}")
        self.plan = list(plan)
        self.faulty_rank = faulty_rank
        self.faulty = (faulty_location, faulty_every_k, faulty_bit_class, faulty_target)
        self.faulty_rate = faulty_rate
        self.faulty_shape = {"bits": faulty_bits, "elements": faulty_elements, "stride": faulty_stride}
        self.injector: BitFlipInjector | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["injector"] = None  # hooks live in the process that trains
        return state

    @property
    def records(self) -> list[FlipRecord]:
        return [] if self.injector is None else list(self.injector.records)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.injector = BitFlipInjector(pl_module, list(trainer.optimizers), rank=trainer.global_rank)
        if self.faulty_rank == trainer.global_rank:
            location, every_k, bit_class, target = self.faulty
            self.injector.faulty_device(location, every_k, bit_class=bit_class, target=target, rate=self.faulty_rate,
                                        **self.faulty_shape)  # fmt: skip

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        assert self.injector is not None
        self.injector.on_step(trainer.global_step, self.plan)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.injector is not None:
            self.injector.remove()
