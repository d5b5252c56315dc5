"""The training loops the benchmarks measure and their clock: a tiny GPT trained by a plain loop (the state every
benchmark checkpoints), every tensor of a training state, and per-step times (CUDA events on a GPU)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

__all__ = ["GPTWorkload", "StepClock", "state_tensors"]


def state_tensors(state: Any) -> list[Any]:
    """Every tensor of a (nested) training state, as the checkpoint engine flattens it."""
    from lightning_resilience.checkpoint.tree import flatten_state

    return list(flatten_state(state).tensors.values())


class GPTWorkload:
    """A TinyGPT trained by a plain loop on fixed random token batches: the state every benchmark checkpoints.

    Args:
        model_kwargs: TinyGPT keywords (``recipes._gpt.gpt_preset`` or a custom size).
        batch_size: sequences per step.
        seed: seeds the weights and the batches.
        optimizer: ``"adamw"`` (the model's own AdamW + LR schedule) or ``"sgd"`` (plain SGD, no momentum).
        trainable: which parameters train (by name); the others are frozen. None trains all.
        device: where the model, its optimizer state and the batches live (built there directly).
        dtype: parameter dtype (e.g. ``torch.bfloat16`` on a GPU); None keeps float32.
    """

    def __init__(
        self,
        model_kwargs: dict[str, Any],
        batch_size: int,
        seed: int = 0,
        *,
        optimizer: str = "adamw",
        trainable: Callable[[str], bool] | None = None,
        device: str = "cpu",
        dtype: Any = None,
    ) -> None:
        import torch

        from recipes._gpt import TinyGPT

        torch.manual_seed(seed)
        with torch.device(device):
            self.model = TinyGPT(**model_kwargs)
        if dtype is not None:
            self.model.to(dtype=dtype)
        self.model.train()
        if trainable is not None:
            for name, param in self.model.named_parameters():
                param.requires_grad_(trainable(name))
        self.sched: Any = None
        if optimizer == "adamw":
            conf = self.model.configure_optimizers()
            self.opt: torch.optim.Optimizer = conf["optimizer"]
            self.sched = conf["lr_scheduler"]["scheduler"]
        elif optimizer == "sgd":
            self.opt = torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=0.1, momentum=0.0)
        else:
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
        gen = torch.Generator().manual_seed(seed)
        vocab, seq = model_kwargs["vocab_size"], model_kwargs["seq_len"]
        self.batches = [torch.randint(vocab, (batch_size, seq + 1), generator=gen).to(device) for _ in range(8)]
        self._i = 0

    def step(self) -> Any:
        """One optimizer step; returns the detached loss tensor (not read: on a GPU reading it would synchronize)."""
        batch = self.batches[self._i % len(self.batches)]
        self._i += 1
        loss = self.model.compute_loss(batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.sched is not None:
            self.sched.step()
        return loss.detach()

    def state(self) -> dict[str, Any]:
        """Model, optimizer and (if any) LR scheduler state dicts: references, not copies."""
        state: dict[str, Any] = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        if self.sched is not None:
            state["sched"] = self.sched.state_dict()
        return state

    def snapshot(self, step: int) -> Any:
        """What the engine's host snapshot would hold: the flattened state with its tensors copied."""
        from lightning_resilience.checkpoint.snapshot import StagedSnapshot
        from lightning_resilience.checkpoint.tree import flatten_state

        flat = flatten_state(self.state())
        return StagedSnapshot(step, flat.skeleton, {n: t.detach().clone() for n, t in flat.tensors.items()}, {})

    def param_counts(self) -> tuple[int, int]:
        """Trainable and total parameters."""
        params = list(self.model.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


class StepClock:
    """Per-step times of a training loop: host wall time on the CPU; on a GPU, CUDA events on the training stream
    (read after the block, so timing never synchronizes a step), which also count the time the device sat idle
    while the host was blocked."""

    def __init__(self, device: str = "cpu") -> None:
        self.cuda = device.startswith("cuda")
        self._marks: list[Any] = []

    def mark(self) -> None:
        """A step boundary (call before the first step of a block and after every step)."""
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            import time

            self._marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks since the last call (waits for the device once, at the end)."""
        marks, self._marks = self._marks, []
        if self.cuda and marks:
            marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(marks)]
        return [b - a for a, b in itertools.pairwise(marks)]
