"""Bit-flip fault injection for tests and drills, as the field sees it: bits of elements of a parameter, a gradient,
an optimizer state tensor or an activation, at a chosen (rank, step), reproducible from a seed; and a "faulty
device" that corrupts one rank's results every k-th time, or at a rate.

A flip is one bit of one element by default. Real GPU corruption is often wider (single-bit flips are under 40% of
flip events in the 2026 field study, arXiv 2605.04213): ``bits`` flips a burst of adjacent bits of each element (the
chosen bit and those below it), ``elements`` flips that many elements ``stride`` apart (a faulty lane, a row).

Gradient flips go through a tensor hook on the parameter, so the corrupt value is what this rank contributes to a
DDP all-reduce; activation flips go through a forward hook. Both fire once (or, for a faulty device, every k-th call
or at its rate) and stay armed until then. A save that writes another step's tensors is a tier fault:
:class:`~lightning_resilience.testing.faults.FaultPlan`'s ``stale`` action.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

__all__ = [
    "BIT_CLASSES",
    "LOCATIONS",
    "BitFlipInjector",
    "FlipRecord",
    "FlipSpec",
    "bit_positions",
    "flip_bit_",
]

BitClass = Literal["sign", "exponent", "mantissa_high", "mantissa_low"]
Location = Literal["param", "grad", "optim", "activation"]
BIT_CLASSES: tuple[str, ...] = ("sign", "exponent", "mantissa_high", "mantissa_low")
LOCATIONS: tuple[str, ...] = ("param", "grad", "optim", "activation")

# (sign bit, exponent bits, mantissa bits) of each floating dtype
_LAYOUT: dict[torch.dtype, tuple[int, range, int]] = {
    torch.float64: (63, range(52, 63), 52),
    torch.float32: (31, range(23, 31), 23),
    torch.float16: (15, range(10, 15), 10),
    torch.bfloat16: (15, range(7, 15), 7),
}
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_positions(dtype: torch.dtype, bit_class: str) -> list[int]:
    """Bit indices (0 = least significant) of ``bit_class`` in ``dtype``.

    The mantissa is split in a high part (its top third: relative change >= 2**-(1/3 of the mantissa)) and a low
    part (its bottom third: changes close to the rounding error of the format).
    """
    if dtype not in _LAYOUT:
        raise ValueError(f"bit flips need a floating dtype, got {dtype}")
    sign, exponent, mantissa = _LAYOUT[dtype]
    third = max(1, mantissa // 3)
    classes = {
        "sign": [sign],
        "exponent": list(exponent),
        "mantissa_high": list(range(mantissa - third, mantissa)),
        "mantissa_low": list(range(third)),
    }
    if bit_class not in classes:
        raise ValueError(f"bit_class must be one of {BIT_CLASSES}, got {bit_class!r}")
    return classes[bit_class]


def flip_bit_(tensor: torch.Tensor, index: int, bit: int) -> tuple[float, float]:
    """Flip bit ``bit`` of element ``index`` (row-major) of ``tensor`` in place; returns (before, after)."""
    width = tensor.element_size() * 8
    if not 0 <= bit < width:
        raise ValueError(f"bit must be in [0, {width}), got {bit}")
    with torch.no_grad():
        flat = tensor.detach().view(-1)
        before = float(flat[index])
        ints = flat.view(_INT_OF_WIDTH[tensor.element_size()])
        mask = -(1 << bit) if bit == width - 1 else 1 << bit  # the sign bit of a signed view is negative
        ints[index] = ints[index] ^ mask
        return before, float(flat[index])


@dataclass
class FlipSpec:
    """One planned flip.

    Args:
        location: 'param', 'grad', 'optim' (optimizer state) or 'activation'.
        step: the step (optimizer steps done so far) at which it happens.
        rank: the rank that flips.
        bit_class: 'sign', 'exponent', 'mantissa_high' or 'mantissa_low' (ignored when ``bit`` is given).
        target: parameter name (param, grad, optim) or module name (activation); None: chosen from the seed.
        element: flat element index; None: chosen from the seed.
        bit: explicit bit index; None: chosen in ``bit_class`` from the seed.
        seed: with the other fields, fixes every random choice.
        bits: bits flipped in each element: the chosen bit and the ``bits - 1`` below it (a multi-bit burst).
        elements: elements flipped, ``stride`` apart from the chosen one (wrapping at the tensor's end).
        stride: distance between two flipped elements (row-major).
    """

    location: Location
    step: int
    rank: int = 0
    bit_class: BitClass = "exponent"
    target: str | None = None
    element: int | None = None
    bit: int | None = None
    seed: int = 0
    bits: int = 1
    elements: int = 1
    stride: int = 1

    def __post_init__(self) -> None:
        if self.location not in LOCATIONS:
            raise ValueError(f"inject.location must be one of {LOCATIONS}, got {self.location!r}")
        if self.bit_class not in BIT_CLASSES:
            raise ValueError(f"inject.bit_class must be one of {BIT_CLASSES}, got {self.bit_class!r}")
        for key in ("bits", "elements", "stride"):
            if getattr(self, key) < 1:
                raise ValueError(f"inject.{key} must be >= 1, got {getattr(self, key)}")

    def rng(self) -> random.Random:
        # str seeds hash deterministically across processes
        return random.Random(f"{self.seed}:{self.location}:{self.step}:{self.rank}:{self.bit_class}:{self.target}")


@dataclass
class FlipRecord:
    """A flip that happened."""

    spec: FlipSpec
    tensor: str
    element: int
    bit: int
    before: float
    after: float
    call: int = 0
    """For hooks: which call of the hook flipped (a faulty device flips several)."""
    elements: list[int] = field(default_factory=list)
    """Every element flipped (``element`` first), for a strided flip."""
    bits: list[int] = field(default_factory=list)
    """Every bit flipped in each element (``bit`` first), for a multi-bit flip."""


@dataclass
class _Armed:
    spec: FlipSpec
    handle: Any
    every_k: int = 0
    rate: float = 1.0
    calls: int = 0
    flips: list[FlipRecord] = field(default_factory=list)
    draws: random.Random | None = None
    """A faulty device's own stream: whether each call is corrupted (at its rate) and where."""


class BitFlipInjector:
    """Flips bits in a model's tensors on one rank.

    Args:
        model: the module whose parameters, gradients and activations are targets.
        optimizers: optimizers whose state tensors are targets of 'optim' flips.
        rank: this process's rank; specs for other ranks are ignored.
    """

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = (), *, rank: int = 0) -> None:
        self.model = model
        self.optimizers = list(optimizers)
        self.rank = rank
        self.records: list[FlipRecord] = []
        self._armed: list[_Armed] = []

    # ------------------------------------------------------------------ targets
    def _params(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad and p.dtype in _LAYOUT}

    def _optim_state(self) -> dict[str, torch.Tensor]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        out: dict[str, torch.Tensor] = {}
        for i, opt in enumerate(self.optimizers):
            for param, state in opt.state.items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dtype in _LAYOUT and value.numel() > 1:
                        out[f"optim{i}.{names.get(id(param), id(param))}.{key}"] = value
        return out

    def _modules(self) -> dict[str, nn.Module]:
        return {n: m for n, m in self.model.named_modules() if n and not list(m.children())}

    @staticmethod
    def _pick(spec: FlipSpec, names: Sequence[str], what: str) -> str:
        if spec.target is not None:
            if spec.target not in names:
                raise ValueError(f"inject.target {spec.target!r} is not a {what}; known: {sorted(names)[:8]}...")
            return spec.target
        if not names:
            raise ValueError(f"no {what} to flip a bit in (optimizer state exists after the first step)")
        return spec.rng().choice(sorted(names))

    @staticmethod
    def _element_and_bit(spec: FlipSpec, tensor: torch.Tensor, rng: random.Random) -> tuple[int, int]:
        element = spec.element if spec.element is not None else rng.randrange(tensor.numel())
        bit = spec.bit if spec.bit is not None else rng.choice(bit_positions(tensor.dtype, spec.bit_class))
        return element, bit

    @staticmethod
    def _flip(spec: FlipSpec, name: str, tensor: torch.Tensor, element: int, bit: int, call: int = 0) -> FlipRecord:
        """Flip the spec's elements and bits, starting at ``element`` and ``bit``, in place."""
        n = tensor.numel()
        elements = list(dict.fromkeys((element + k * spec.stride) % n for k in range(spec.elements)))
        bits = list(range(bit, max(bit - spec.bits, -1), -1))
        before = after = 0.0
        for i, e in enumerate(elements):
            for j, b in enumerate(bits):
                was, now = flip_bit_(tensor, e, b)
                if i == 0:
                    before, after = (was, now) if j == 0 else (before, now)
        return FlipRecord(spec, name, element, bit, before, after, call=call, elements=elements, bits=bits)

    # ------------------------------------------------------------------ public
    def inject(self, spec: FlipSpec, *, every_k: int = 0, rate: float = 1.0) -> FlipRecord | None:
        """Carry out ``spec`` on this rank: flip now (param, optim) or arm a one-shot hook (grad, activation).

        With ``every_k > 0`` a grad or activation hook stays armed and flips on every k-th call (a faulty device),
        each of those calls with probability ``rate`` (drawn from the spec's seed). Returns the record of an
        immediate flip; hook flips are appended to :attr:`records` when they fire.
        """
        if spec.rank != self.rank:
            return None
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"inject.rate must be in (0, 1], got {rate}")
        if spec.location in ("param", "optim"):
            if every_k:
                raise ValueError("a faulty device corrupts results (grad, activation), not stored state")
            tensors: dict[str, torch.Tensor] = dict(self._params()) if spec.location == "param" else self._optim_state()
            name = self._pick(spec, list(tensors), "parameter" if spec.location == "param" else "optimizer state")
            tensor = tensors[name]
            element, bit = self._element_and_bit(spec, tensor, spec.rng())
            record = self._flip(spec, name, tensor, element, bit)
            self.records.append(record)
            return record
        if spec.location == "grad":
            params = self._params()
            name = self._pick(spec, list(params), "parameter")
            armed = _Armed(spec, None, every_k, rate, draws=spec.rng())
            armed.handle = params[name].register_hook(self._grad_hook(armed, name))
        else:
            modules = self._modules()
            name = self._pick(spec, list(modules), "leaf module")
            armed = _Armed(spec, None, every_k, rate, draws=spec.rng())
            armed.handle = modules[name].register_forward_hook(self._activation_hook(armed, name))
        self._armed.append(armed)
        return None

    def faulty_device(self, location: Location, every_k: int = 1, *, bit_class: BitClass = "exponent",
                      target: str | None = None, seed: int = 0, rate: float = 1.0, bits: int = 1,
                      elements: int = 1, stride: int = 1) -> None:  # fmt: skip
        """From now on, corrupt the gradient or activation results of ``target`` on this rank: every
        ``every_k``-th one, each with probability ``rate`` (1: always), ``bits`` adjacent bits of ``elements``
        elements ``stride`` apart."""
        if every_k < 1:
            raise ValueError(f"inject.every_k must be >= 1, got {every_k}")
        spec = FlipSpec(location, step=-1, rank=self.rank, bit_class=bit_class, target=target, seed=seed, bits=bits,
                        elements=elements, stride=stride)  # fmt: skip
        self.inject(spec, every_k=every_k, rate=rate)

    def on_step(self, step: int, plan: Sequence[FlipSpec]) -> list[FlipRecord]:
        """Carry out the specs of ``plan`` due at ``step`` on this rank; returns the immediate flips."""
        out = []
        for spec in plan:
            if spec.step == step and spec.rank == self.rank:
                record = self.inject(spec)
                if record is not None:
                    out.append(record)
        return out

    @property
    def pending(self) -> int:
        """Hooks armed and not yet fired (faulty devices count as pending forever)."""
        return len(self._armed)

    def remove(self) -> None:
        """Disarm every hook (a faulty device is repaired)."""
        for armed in self._armed:
            armed.handle.remove()
        self._armed = []

    # ------------------------------------------------------------------ hooks
    def _fire(self, armed: _Armed, name: str, tensor: torch.Tensor) -> torch.Tensor:
        armed.calls += 1
        if armed.every_k and armed.calls % armed.every_k != 0:
            return tensor
        rng = armed.draws or armed.spec.rng()
        if armed.rate < 1.0 and rng.random() >= armed.rate:  # a flaky device: this result comes out right
            return tensor
        out = tensor.clone()  # keeps the autograd graph of an activation; the flip itself is not differentiated
        element, bit = self._element_and_bit(armed.spec, out, rng)  # a fresh place each time, reproducibly
        record = self._flip(armed.spec, name, out, element, bit, call=armed.calls)
        armed.flips.append(record)
        self.records.append(record)
        if not armed.every_k:
            armed.handle.remove()
            self._armed.remove(armed)
        return out

    def _grad_hook(self, armed: _Armed, name: str) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            return self._fire(armed, name, grad)

        return hook

    def _activation_hook(self, armed: _Armed, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if isinstance(output, torch.Tensor) and output.dtype in _LAYOUT:
                return self._fire(armed, name, output)
            if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                return (self._fire(armed, name, output[0]), *output[1:])
            return output

        return hook
