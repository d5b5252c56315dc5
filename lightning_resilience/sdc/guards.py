"""Always-on guards: NaN/Inf in the loss and gradients, robust spikes of the loss, the gradient norm and the
parameter norm against a running median/MAD baseline.

A guard never decides on its own that data is corrupt: it asks for a replay, which tells a corrupt step from a step
whose numbers are genuinely unusual.

The values are computed where the model lives; :class:`GuardReader` brings them to the host. With a read lag of one
step (the default) they travel by a non-blocking copy into pinned memory and are checked at the next step, so the
step path never waits for the device; with no lag they are read (one host read) before the optimizer step.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

import torch

from lightning_resilience._staging import HostStage

__all__ = ["PARAM_GUARDS", "GuardReader", "GuardReport", "Guards", "RobustBaseline", "grad_norm", "param_norm"]

_MAD_TO_SIGMA = 1.4826
_JUMP = "param_norm_jump"
PARAM_GUARDS = (_JUMP, "nonfinite_param")
"""Guards about stored state: a replay does not cover them, a reconciliation does."""


class RobustBaseline:
    """Median and MAD of the last ``window`` accepted values; ``zscore`` says how far a new value lies outside.

    Args:
        window: values kept.
        min_history: values needed before :meth:`zscore` answers.
        rel_floor: the spread is at least this fraction of ``|median|`` (a flat series would make any change a spike).
    """

    def __init__(self, window: int, min_history: int, rel_floor: float = 1e-3) -> None:
        self._values: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []  # the same values in order: the median is read, not sorted for
        self.min_history = min_history
        self.rel_floor = rel_floor

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float) -> None:
        if math.isfinite(value):
            if len(self._values) == self._values.maxlen:
                del self._sorted[bisect.bisect_left(self._sorted, self._values[0])]
            self._values.append(value)
            bisect.insort(self._sorted, value)

    def median_abs(self) -> float:
        return _median([abs(v) for v in self._sorted]) if self._sorted else 0.0

    def zscore(self, value: float, floor: float = 0.0) -> float | None:
        if len(self._values) < self.min_history:
            return None
        med = _middle(self._sorted)
        mad = _median([abs(v - med) for v in self._sorted])  # two runs in order: the sort merges them
        scale = max(_MAD_TO_SIGMA * mad, self.rel_floor * abs(med), floor, 1e-12)
        return abs(value - med) / scale


def _median(values: list[float]) -> float:
    values.sort()
    return _middle(values)


def _middle(ordered: list[float]) -> float:
    """The median of values already in order."""
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


@dataclass
class GuardReport:
    """What the guards saw at one step."""

    step: int
    fired: list[str] = field(default_factory=list)
    loss: float | None = None
    grad_norm: float | None = None
    param_norm: float | None = None
    replayed: bool = False
    """A replay round verified this step's gradients (read late: a spike then is genuine, not a fault)."""
    quiet: list[str] = field(default_factory=list)
    """Guards among ``fired`` that ask for no round: the same guard's spike was found genuine by a replay, or a
    parameter-norm jump by a clean reconciliation, at most ``quiet_steps`` steps before (a training instability that
    spikes or grows many checks in a row)."""

    def asks_replay(self) -> list[str]:
        """The guards that fired on what the step computed (not stored state) and are not quiet."""
        return [f for f in self.fired if f not in PARAM_GUARDS and f not in self.quiet]

    def asks_reconciliation(self) -> bool:
        """A guard about stored state fired and is not quiet."""
        return any(f in PARAM_GUARDS and f not in self.quiet for f in self.fired)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm(tensors, 2.0)``, in three operations where the tensors are plain (not a tensor
    subclass such as a DTensor shard) and share a device with a fused per-tensor norm and a dtype: the same ops, without
    a call per tensor to gather the norms."""
    first = tensors[0]
    if first.device.type in ("cpu", "cuda") and all(
        type(t) in _PLAIN and t.device == first.device and t.dtype == first.dtype for t in tensors
    ):
        with torch.no_grad():
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors, 2.0)), 2.0)
    return torch.nn.utils.get_total_norm(tensors, norm_type=2.0)


def grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """L2 norm of all gradients (NaN or Inf if any element is) as a 0-d tensor where they live: one fused pass,
    nothing read to the host. None when no parameter has a gradient."""
    grads = [p.grad for p in params if p.grad is not None]
    return _total_norm(grads) if grads else None


def param_norm(params: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """L2 norm of all parameters as a 0-d tensor where they live (nothing read to the host); None without any."""
    tensors = list(params)
    return _total_norm(tensors) if tensors else None


class Guards:
    """Loss, gradient-norm and parameter-norm guards with their baselines.

    Call :meth:`check` before the optimizer step, then :meth:`accept` with the report once the step is known good
    (values of a corrupt step never enter the baselines), :meth:`genuine` with a report whose spike a replay found
    genuine and :meth:`reconciled` with the step of a clean reconciliation a parameter-norm jump asked for: the same
    guard's findings of the next ``quiet_steps`` steps are reported ``quiet``. A quiet period never hides a fault for
    longer than it lasts: the scheduled rounds go on, and a non-finite value is never quiet.
    """

    def __init__(self, window: int, min_history: int, threshold: float, quiet_steps: int = 0) -> None:
        self.threshold = threshold
        self.quiet_steps = quiet_steps
        self._window, self._min_history = window, min_history
        self.reset()

    def reset(self) -> None:
        """Forget every baseline, count and quiet period (a run that starts over from the same initial state)."""
        self._genuine: dict[str, int] = {}  # guard -> the step its latest finding was found genuine at
        self.loss = RobustBaseline(self._window, self._min_history)
        self.log_grad_norm = RobustBaseline(self._window, self._min_history)
        self.param_norm_delta = RobustBaseline(self._window, self._min_history, rel_floor=0.0)
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
                    report.fired.append(_JUMP)
        for name in report.fired:
            self.fired[name] = self.fired.get(name, 0) + 1
        report.quiet = [f for f in report.fired if 0 < step - self._genuine.get(f, step) <= self.quiet_steps]
        return report

    def genuine(self, report: GuardReport) -> None:
        """A replay found the spikes of ``report`` genuine: the same guards' spikes of the next ``quiet_steps`` steps
        ask for no replay (a non-finite value always does)."""
        for name in report.fired:
            if name.endswith("_spike"):
                self._genuine[name] = report.step

    def reconciled(self, step: int) -> None:
        """A reconciliation that a parameter-norm jump asked for found the replicas' state equal at ``step``: the jump
        was the training's own, and the jumps of the next ``quiet_steps`` steps ask for no reconciliation (the
        scheduled ones go on)."""
        self._genuine[_JUMP] = step

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


_LOSS, _GRAD, _PARAM = "loss", "grad_norm", "param_norm"


class GuardReader:
    """Computes a step's guard values on the device and checks them on the host, now or one step later.

    Args:
        guards: the baselines and thresholds.
        lag: 0 reads the values before the optimizer step (one host read per step on a GPU); 1 or more stages them
            to the host without waiting and checks them once the copy has landed (at the next step on a CPU; on a
            GPU when the device has caught up, at most ``lag + 2`` steps later).
    """

    def __init__(self, guards: Guards, lag: int) -> None:
        if lag < 0:
            raise ValueError(f"guard read lag must be >= 0, got {lag}")
        self.guards = guards
        self.lag = lag
        self._stage = HostStage(max_pending=lag + 2)

    @property
    def forced_reads(self) -> int:
        """Readings the host had to wait for (the device was more than ``lag + 2`` steps behind)."""
        return self._stage.forced_reads

    def observe(
        self,
        step: int,
        loss: torch.Tensor | None,
        grad: torch.Tensor | None,
        param: torch.Tensor | None,
        *,
        replayed: bool = False,
    ) -> GuardReport | None:
        """Record step ``step``'s values (0-d tensors, None: not measured). With no lag, returns the checked report
        (values not yet accepted); otherwise stages them and returns None. ``replayed``: a replay round verified
        this step's gradients already (its report comes back with ``replayed`` set)."""
        names = tuple(n for n, v in ((_LOSS, loss), (_GRAD, grad), (_PARAM, param)) if v is not None)
        if not names:
            return None
        values = [v if v.dim() == 0 else v.reshape(()) for v in (loss, grad, param) if v is not None]
        if self.lag == 0:
            with torch.no_grad():
                return self._check(step, names, torch.stack(values).to(torch.float64).tolist())
        self._stage.put((step, names, replayed), values)
        return None

    def arrived(self) -> list[GuardReport]:
        """Checked reports of the staged steps whose values reached the host, oldest first (never waits)."""
        out = []
        for key, values in self._stage.ready():
            step, names, replayed = cast(tuple[int, tuple[str, ...], bool], key)
            report = self._check(step, names, values)
            report.replayed = replayed
            out.append(report)
        return out

    def clear(self) -> None:
        self._stage.clear()

    def _check(self, step: int, names: tuple[str, ...], values: list[float]) -> GuardReport:
        got = dict(zip(names, values))
        return self.guards.check(step, got.get(_LOSS), got.get(_GRAD), got.get(_PARAM))
