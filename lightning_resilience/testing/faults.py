"""Deterministic fault injection for tests and drills: ``fail_at(rank, step, operation)``.

In the spirit of torchft's ``EventInjector``: a :class:`FaultPlan` lists faults, each firing when a given rank
reaches a given step of a given operation, and the places that can fail consult it:

* **tiers** — :meth:`FaultPlan.instrument` wraps a tier instance's operations (``tier.<name>.write``, ``.read``,
  ``.list``, ``.delete``, ``.take``, ``.holds``, ``.prepare``); the tier stays the same object (``isinstance`` and
  every attribute unchanged);
* **collectives** — while the plan is armed (:meth:`FaultPlan.armed`), every side-group operation of
  :mod:`lightning_resilience.collective` (``checkpoint.agree``, ``peer.exchange``, ``policy.decide``...);
* **internal fault points** — named functions deeper down (:data:`POINTS`, e.g. ``local.write_shard``: the shard
  writer inside a tier's commit), patched while armed.

An operation name may be a glob (``tier.*.write``). Actions: ``raise`` (an :class:`InjectedFault`, an
``OSError``: a disk or network fault), ``error`` (an :class:`InjectedError`, a ``RuntimeError``: a bug), ``hang``
(block until :meth:`FaultPlan.release` or ``hang_limit``; the rank is alive but never arrives), ``delay`` (sleep
``seconds``: a slow disk or peer), ``exit`` (``os._exit(code)``: the rank dies, for drills), ``stale`` (a tier's
``write`` commits the tensors of the previous step it wrote under the new step's name and metadata, and succeeds:
the silent save bug of an async checkpointer whose staging buffers were not refreshed).

A drill in a subprocess arms a plan from the environment: ``LR_FAULTS='[{"rank": 1, "step": 8, "operation":
"tier.local.write", "action": "raise"}]'`` and, in the script, ``plan = arm_from_env()`` then
``plan.instrument(tier)`` for its tiers (``FaultPlan.to_env()`` writes the variable).
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from lightning_resilience import collective
from lightning_resilience.checkpoint.layout import parse_step

__all__ = [
    "ENV",
    "POINTS",
    "Fault",
    "FaultPlan",
    "InjectedError",
    "InjectedFault",
    "arm_from_env",
]

ENV = "LR_FAULTS"
ACTIONS = ("raise", "error", "hang", "delay", "exit", "stale")
T = TypeVar("T")


class InjectedFault(OSError):
    """An injected I/O or network fault (what a full disk or a reset connection raises)."""


class InjectedError(RuntimeError):
    """An injected bug (what a library raising something unexpected looks like)."""


def _step_of_snapshot(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    snap = kwargs.get("snap", args[1] if len(args) > 1 else None)
    return getattr(snap, "step", None)


def _step_of_upload(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    key = str(kwargs.get("remote", args[2] if len(args) > 2 else ""))
    parts = key.rsplit("/", 3)  # .../step_000000000004/rank_00000/<file>
    return parse_step(parts[-3]) if len(parts) == 4 else None


POINTS: dict[str, tuple[str, str, Callable[[tuple[Any, ...], dict[str, Any]], int | None]]] = {
    "local.write_shard": ("lightning_resilience.checkpoint.local", "write_shard", _step_of_snapshot),
    "delta.seal_shard": ("lightning_resilience.checkpoint.delta_tier", "seal_shard", _step_of_snapshot),
    "remote.upload": ("lightning_resilience.checkpoint.remote", "RemoteTier._upload", _step_of_upload),
}
"""Internal fault points: operation -> (module, attribute, how to find the step in the call's arguments). The
attribute (a function of the module, or ``Class.method``) is replaced while the plan is armed:
``local.write_shard`` is the shard writer inside a directory tier's commit, ``delta.seal_shard`` the sealing of a
delta shard, ``remote.upload`` one file's upload of a remote tier (the manifest is uploaded last)."""


@dataclass(frozen=True)
class Fault:
    """One fault: when ``rank`` reaches ``step`` of ``operation``, do ``action`` (``times`` times; 0: always).

    ``rank`` or ``step`` None matches any.
    """

    operation: str
    rank: int | None = None
    step: int | None = None
    action: str = "raise"
    times: int = 1
    seconds: float = 0.0
    """For ``delay``: how long."""
    code: int = 1
    """For ``exit``: the exit status."""

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"fault action must be one of {ACTIONS}, got {self.action!r}")
        if self.times < 0:
            raise ValueError(f"fault times must be >= 0, got {self.times}")

    def matches(self, operation: str, rank: int, step: int | None) -> bool:
        return (
            fnmatch.fnmatchcase(operation, self.operation)
            and (self.rank is None or self.rank == rank)
            and (self.step is None or self.step == step)
        )


@dataclass(frozen=True)
class Fired:
    """A record of one fault that fired."""

    operation: str
    rank: int
    step: int | None
    action: str


class FaultPlan:
    """A list of faults and the record of those that fired.

    Args:
        faults: the faults (more with :meth:`fail_at`).
        hang_limit: longest a ``hang`` blocks without :meth:`release` (then it raises :class:`InjectedFault`), so a
            test that forgets to release still ends.
    """

    def __init__(self, faults: list[Fault] | None = None, *, hang_limit: timedelta = timedelta(seconds=300)) -> None:
        self.faults: list[Fault] = list(faults or [])
        self.hang_limit = hang_limit
        self.fired: list[Fired] = []
        self._left: dict[int, int] = {}
        self._lock = threading.Lock()
        self._released = threading.Event()
        self.hanging = threading.Event()
        """Set while some operation is blocked by a ``hang`` fault (a test waits on it instead of sleeping)."""

    def fail_at(
        self,
        rank: int | None,
        step: int | None,
        operation: str,
        action: str = "raise",
        *,
        times: int = 1,
        seconds: float = 0.0,
        code: int = 1,
    ) -> FaultPlan:
        """Add a fault; returns the plan (chainable)."""
        self.faults.append(Fault(operation, rank, step, action, times, seconds, code))
        return self

    # ------------------------------------------------------------------ firing
    def check(self, operation: str, rank: int | None = None, step: int | None = None) -> str | None:
        """Fire the first fault that matches this call (if any has calls left); returns the action of a fault the
        caller carries out itself (``stale``), else None."""
        me = _current_rank() if rank is None else rank
        with self._lock:
            fault = None
            for index, candidate in enumerate(self.faults):
                left = self._left.setdefault(index, candidate.times)
                if candidate.matches(operation, me, step) and (candidate.times == 0 or left > 0):
                    self._left[index] = left - 1
                    fault = candidate
                    break
            if fault is None:
                return None
            self.fired.append(Fired(operation, me, step, fault.action))
        what = f"injected {fault.action} at {operation} (rank {me}, step {step})"
        if fault.action == "raise":
            raise InjectedFault(what)
        if fault.action == "error":
            raise InjectedError(what)
        if fault.action == "delay":
            time.sleep(fault.seconds)
        elif fault.action == "hang":
            self.hanging.set()
            if not self._released.wait(self.hang_limit.total_seconds()):
                raise InjectedFault(f"{what}: never released within {self.hang_limit}")
        elif fault.action == "exit":
            os._exit(fault.code)
        elif fault.action == "stale":
            return fault.action
        return None

    def release(self) -> None:
        """Unblock every ``hang`` (now and later)."""
        self._released.set()

    # ------------------------------------------------------------------ where faults fire
    def instrument(self, tier: T) -> T:
        """Make ``tier``'s operations consult the plan (``tier.<name>.<op>``); returns the same object."""
        name = getattr(tier, "name", type(tier).__name__)

        def wrap(method: str, op: str, step_of: Callable[..., int | None]) -> None:
            original = getattr(tier, method, None)
            if original is None:
                return

            def call(*args: Any, **kwargs: Any) -> Any:
                self.check(f"tier.{name}.{op}", step=step_of(*args, **kwargs))
                return original(*args, **kwargs)

            setattr(tier, method, call)

        def first_step(step: int, *_: Any, **__: Any) -> int:
            return step

        def snapshot_step(snap: Any, *_: Any, **__: Any) -> int | None:
            return getattr(snap, "step", None)

        def no_step(*_: Any, **__: Any) -> None:
            return None

        written: list[Any] = []  # the last snapshot this tier wrote (a copy), for a stale write

        def write(method: str) -> None:
            original = getattr(tier, method, None)
            if original is None:
                return

            def call(snap: Any, *args: Any, **kwargs: Any) -> Any:
                action = self.check(f"tier.{name}.write", step=snapshot_step(snap))
                if action == "stale" and written:
                    stale = written[-1]
                    snap = type(snap)(snap.step, stale.skeleton, stale.tensors, dict(snap.meta))
                elif any(f.action == "stale" for f in self.faults):
                    written[:] = [snap.clone()]
                return original(snap, *args, **kwargs)

            setattr(tier, method, call)

        write("write")
        write("write_local")
        wrap("read", "read", first_step)
        wrap("delete", "delete", first_step)
        wrap("take", "take", first_step)
        wrap("holds", "holds", first_step)
        wrap("list_steps", "list", no_step)
        wrap("prepare_restore", "prepare", no_step)
        return tier

    @contextlib.contextmanager
    def armed(self) -> Iterator[FaultPlan]:
        """While inside: side-group operations and the internal fault points of the plan's faults consult it."""

        def hook(op: str, rank: int, step: int | None) -> None:
            self.check(op, rank, step)

        previous = collective.set_fault_hook(hook)
        restore: list[tuple[Any, str, Any]] = []
        try:
            for operation, (module_name, attr, step_of) in POINTS.items():
                if not any(fnmatch.fnmatchcase(operation, f.operation) for f in self.faults):
                    continue
                owner: Any = importlib.import_module(module_name)
                *path, name = attr.split(".")
                for part in path:
                    owner = getattr(owner, part)
                original = getattr(owner, name)
                restore.append((owner, name, original))
                setattr(owner, name, self._point(operation, original, step_of))
            yield self
        finally:
            for module, attr, original in reversed(restore):
                setattr(module, attr, original)
            collective.set_fault_hook(previous)

    def _point(
        self, operation: str, original: Callable[..., Any], step_of: Callable[[tuple[Any, ...], dict[str, Any]], Any]
    ) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.check(operation, step=step_of(args, kwargs))
            return original(*args, **kwargs)

        return call

    # ------------------------------------------------------------------ subprocesses
    def to_env(self) -> str:
        """The value of :data:`ENV` that makes :func:`arm_from_env` rebuild this plan in a subprocess."""
        return json.dumps([asdict(f) for f in self.faults])

    @classmethod
    def from_env(cls, value: str | None = None) -> FaultPlan | None:
        """The plan described by :data:`ENV` (or ``value``), None when there is none."""
        text = os.environ.get(ENV) if value is None else value
        if not text:
            return None
        try:
            entries = json.loads(text)
            return cls([Fault(**entry) for entry in entries])
        except (ValueError, TypeError) as err:
            raise ValueError(f"{ENV} must be a JSON list of faults like {FAULT_EXAMPLE}, got {text!r} ({err})") from err


FAULT_EXAMPLE = '[{"rank": 1, "step": 8, "operation": "tier.local.write", "action": "raise"}]'


def arm_from_env() -> FaultPlan | None:
    """In a drill's process: arm the plan of :data:`ENV` for the rest of the process (tiers still need
    :meth:`FaultPlan.instrument`). Returns it, or None when the variable is not set."""
    plan = FaultPlan.from_env()
    if plan is not None:
        plan.armed().__enter__()  # for the life of the process: a drill never disarms
    return plan


def _current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
