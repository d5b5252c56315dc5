"""Always-on guards: NaN/Inf in the loss and gradients, robust spikes of the loss, the gradient norm and the
parameter norm against a running median/MAD baseline.

A guard never decides on its own that data is corrupt: it asks for a replay, which tells a corrupt step from a step
whose numbers are genuinely unusual.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

__all__ = ["GuardReport", "Guards", "RobustBaseline", "grad_norm", "param_norm"]

_MAD_TO_SIGMA = 1.4826


class RobustBaseline:
    """Median and MAD of the last ``window`` accepted values; ``zscore`` says how far a new value lies outside.

    Args:
        window: values kept.
        min_history: values needed before :meth:`zscore` answers.
        rel_floor: the spread is at least this fraction of ``|median|`` (a flat series would make any change a spike).
    """

    def __init__(self, window: int, min_history: int, rel_floor: float = 1e-3) -> None:
        self._values: deque[float] = deque(maxlen=window)
        self.min_history = min_history
        self.rel_floor = rel_floor

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self._values.append(value)

    def median_abs(self) -> float:
        return _median([abs(v) for v in self._values]) if self._values else 0.0

    def zscore(self, value: float, floor: float = 0.0) -> float | None:
        if len(self._values) < self.min_history:
            return None
        med = _median(list(self._values))
        mad = _median([abs(v - med) for v in self._values])
        scale = max(_MAD_TO_SIGMA * mad, self.rel_floor * abs(med), floor, 1e-12)
        return abs(value - med) / scale


def _median(values: list[float]) -> float:
    values.sort()
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


@dataclass
class GuardReport:
    """What the guards saw at one step."""

    step: int
    fired: list[str] = field(default_factory=list)
    loss: float | None = None
    grad_norm: float | None = None
    param_norm: float | None = None


def grad_norm(params: Iterable[torch.Tensor]) -> float:
    """L2 norm of all gradients (NaN or Inf if any element is): one fused pass and one scalar read."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.nn.utils.get_total_norm(grads, norm_type=2.0))


def param_norm(params: Iterable[torch.Tensor]) -> float:
    """L2 norm of all parameters."""
    tensors = [p.detach() for p in params]
    if not tensors:
        return 0.0
    return float(torch.nn.utils.get_total_norm(tensors, norm_type=2.0))


class Guards:
    """Loss, gradient-norm and parameter-norm guards with their baselines.

    Call :meth:`check` before the optimizer step, then :meth:`accept` with the report once the step is known good
    (values of a corrupt step never enter the baselines).
    """

    def __init__(self, window: int, min_history: int, threshold: float) -> None:
        self.threshold = threshold
        self.loss = RobustBaseline(window, min_history)
        self.log_grad_norm = RobustBaseline(window, min_history)
        self.param_norm_delta = RobustBaseline(window, min_history, rel_floor=0.0)
        self._last_param_norm: float | None = None
        self.fired: dict[str, int] = {}

    def check(
        self, step: int, loss: float | None, grad_norm: float | None, param_norm: float | None = None
    ) -> GuardReport:
        report = GuardReport(step, loss=loss, grad_norm=grad_norm, param_norm=param_norm)
        if loss is not None:
            if not math.isfinite(loss):
                report.fired.append("nonfinite_loss")
            elif (z := self.loss.zscore(loss)) is not None and z > self.threshold:
                report.fired.append("loss_spike")
        if grad_norm is not None:
            if not math.isfinite(grad_norm):
                report.fired.append("nonfinite_grad")
            elif grad_norm > 0 and (self.log_grad_norm.zscore(math.log(grad_norm)) or 0.0) > self.threshold:
                report.fired.append("grad_norm_spike")
        if param_norm is not None:
            if not math.isfinite(param_norm):
                report.fired.append("nonfinite_param")
            elif self._last_param_norm is not None:
                delta = param_norm - self._last_param_norm
                # the spread is at least the typical change itself: a steady trend is not a jump
                z = self.param_norm_delta.zscore(delta, floor=self.param_norm_delta.median_abs())
                if z is not None and z > self.threshold and abs(delta) > 1e-3 * abs(self._last_param_norm):
                    report.fired.append("param_norm_jump")
        for name in report.fired:
            self.fired[name] = self.fired.get(name, 0) + 1
        return report

    def accept(self, report: GuardReport) -> None:
        """Fold a step known to be good into the baselines."""
        if report.loss is not None:
            self.loss.add(report.loss)
        if report.grad_norm is not None and report.grad_norm > 0:
            self.log_grad_norm.add(math.log(report.grad_norm))
        if report.param_norm is not None and math.isfinite(report.param_norm):
            if self._last_param_norm is not None:
                self.param_norm_delta.add(report.param_norm - self._last_param_norm)
            self._last_param_norm = report.param_norm
