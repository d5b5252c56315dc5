"""A plain training loop (optionally DDP on gloo) with SDC verification, shared by the engine tests and usable in
spawned processes: tiny GPT with dropout, fixed per-rank batches, AdamW, deterministic algorithms."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.sdc.inject import BitFlipInjector, FlipSpec
from lightning_resilience.sdc.monitor import SDCMonitor, StepOutcome
from recipes._gpt import TinyGPT

TINY = dict(vocab_size=32, seq_len=8, d_model=16, n_layer=1, n_head=2, dropout=0.1, warmup_steps=2, max_steps=50)


def make_model(seed: int = 0) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT(**TINY)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    return model, opt


def batches(rank: int, n: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return [torch.randint(TINY["vocab_size"], (4, TINY["seq_len"] + 1), generator=gen) for _ in range(n)]


@dataclass
class Boxed:
    """A batch of the user's own type (not a tensor, dict, list or tuple)."""

    tokens: torch.Tensor


def _unbox(batch: Any) -> torch.Tensor:
    return batch.tokens if isinstance(batch, Boxed) else batch


def train(
    steps: int,
    config: SDCConfig | None,
    *,
    rank: int = 0,
    ddp: bool = False,
    plan: Sequence[FlipSpec] = (),
    faulty_every_k: int = 0,
    faulty_bit_class: str = "exponent",
    seed: int = 0,
    boxed: bool = False,
) -> tuple[dict[str, torch.Tensor], list[StepOutcome], SDCMonitor | None]:
    """Train ``steps`` steps; returns final weights, per-step outcomes (with verification) and the monitor.
    ``boxed``: every batch is a :class:`Boxed` (a type of the user's own)."""
    torch.use_deterministic_algorithms(True)
    model, opt = make_model(seed)
    wrapped: Any = DistributedDataParallel(model) if ddp else model
    data: list[Any] = [Boxed(b) for b in batches(rank, steps)] if boxed else batches(rank, steps)
    torch.manual_seed(100 + rank)  # dropout streams differ per rank
    monitor = None
    if config is not None:
        monitor = SDCMonitor(list(model.named_parameters()), [opt], config)
        monitor.setup()
        monitor.attach(
            lambda b: model.compute_loss(_unbox(b)),
            ddp=wrapped if ddp else None,
            synced_loss_fn=_synced(wrapped) if ddp else None,
        )
    injector = BitFlipInjector(model, [opt], rank=rank)
    if faulty_every_k:
        injector.faulty_device("grad", faulty_every_k, bit_class=faulty_bit_class,  # type: ignore[arg-type]
                               target="blocks.0.mlp.fc.weight")  # fmt: skip
    outcomes: list[StepOutcome] = []
    for step, batch in enumerate(data):
        injector.on_step(step, [s for s in plan if s.location in ("grad", "activation", "param", "optim")])
        if monitor is not None:
            monitor.begin_step(step, batch)
        loss = _synced(wrapped)(batch) if ddp else model.compute_loss(_unbox(batch))
        if monitor is not None:
            monitor.observe_loss(loss)
        loss.backward()
        if monitor is not None:
            outcomes.append(monitor.before_optimizer_step())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if monitor is not None:
            after = monitor.after_optimizer_step()
            outcomes.append(after)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, outcomes, monitor


def _synced(wrapped: Any) -> Any:
    def loss_fn(batch: Any) -> torch.Tensor:
        # the DDP wrapper's forward runs TinyGPT.forward; the loss mirrors TinyGPT.compute_loss
        batch = _unbox(batch)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = wrapped(inputs)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    return loss_fn
