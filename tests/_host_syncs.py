"""Count, on the CPU, what would be a host-device synchronisation on a GPU, made by our code, per training step.

On a GPU the CPU runs ahead of the device; anything that needs a device value on the host (``.item()``,
``float(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``, ``torch.equal``, a blocking device-to-host copy, a float
given to ``self.log``, which Lightning turns into a device tensor) stalls that run-ahead. On a CPU none of these
cost anything, so a CPU test cannot time them: it has to recognise them. :class:`HostSyncCounter` does so with a
``TorchDispatchMode`` that tracks which tensors would live on the device:

* seeds: the model's parameters and buffers, the optimizer's state, the batch (marked at every step start), and
  what a DDP communication hook gets from its bucket;
* propagation: an op with a device input makes device outputs (and marks the tensors it writes in place);
* a *read* is one of the ops above on a device tensor, whose innermost caller outside torch, Lightning and the
  standard library is a file of the ``lightning_resilience`` package (the user's own ``float(loss)`` is not ours);
* copies made by ``checkpoint/snapshot.py`` are the product (the snapshot) and are counted separately as
  ``snapshot_copies``; copies through ``lightning_resilience/_staging.py`` into pinned host buffers with
  ``non_blocking=True`` are asynchronous on a GPU and counted as ``staged``; a blocking one counts as a read;
* a ``self.log``/``log_dict`` call from our code with host (non-tensor) values counts one read per value;
* ``torch.cuda.synchronize``, ``Event.synchronize`` and ``Stream.synchronize`` from our code count as reads
  (they only run on a GPU).

Host tensors our code makes from host values (a flag all-reduced on the gloo side group) are not device tensors
and reading them is free. Events are bucketed per training step (from one ``on_train_batch_start`` to the next);
:meth:`HostSyncCounter.report` gives per-step counts and where each read came from.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

import lightning_resilience

OURS = os.path.dirname(os.path.abspath(lightning_resilience.__file__)) + os.sep
SNAPSHOT_FILE = os.path.join(OURS, "checkpoint", "snapshot.py")
STAGING_FILE = os.path.join(OURS, "_staging.py")


def _package_dir(name: str) -> str | None:
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(file)) + os.sep if file else None


_SKIP = tuple(
    p
    for p in (
        _package_dir("torch"),
        _package_dir("lightning"),
        _package_dir("lightning_fabric"),
        _package_dir("pytorch_lightning"),
        _package_dir("typing_extensions"),
        sysconfig.get_paths()["stdlib"] + os.sep,
        os.path.abspath(__file__),
    )
    if p
)

_aten = torch.ops.aten
READ_OPS = {
    _aten._local_scalar_dense.default,  # item(), float(), int(), bool() of a one-element tensor
    _aten.equal.default,  # torch.equal returns a Python bool
    _aten.is_nonzero.default,
    _aten.nonzero.default,  # output size depends on the data
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
}
COPY_OPS = {_aten.copy_.default, _aten._to_copy.default}


def _caller() -> str | None:
    """``file:line`` of the innermost frame outside torch, Lightning, the stdlib and this harness; None if that
    frame is not ours."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_SKIP) and path != "<string>":
            if path.startswith(OURS):
                return f"{os.path.relpath(path, os.path.dirname(OURS))}:{frame.f_lineno} ({frame.f_code.co_name})"
            return None
        frame = frame.f_back
    return None


def _caller_file() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_SKIP):
            return path
        frame = frame.f_back
    return ""


class _DeviceTracker(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter
        self.device: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def is_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t in self.device

    def mark(self, tensors: Any) -> None:
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor):
                self.device[t] = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = any(t in self.device for t in inputs)
        host_dst = False
        if on_device and func in READ_OPS:
            self.counter._read(f"aten.{func.__name__}")
        elif func is _aten.copy_.default and self.is_device(args[1]) and not self.is_device(args[0]):
            where = _caller_file()
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if where == SNAPSHOT_FILE:
                self.counter._count("snapshot_copies")
                host_dst = True
            elif where == STAGING_FILE:
                host_dst = True
                if non_blocking:
                    self.counter._count("staged")
                else:
                    self.counter._read("blocking copy_ to a host buffer")
        out = func(*args, **kwargs)
        if on_device and not host_dst:
            self.mark(out)
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    self.mark(value)
        return out


class HostSyncCounter(Callback):
    """A Lightning callback (put it first) that counts our host reads of device tensors per training step.

    Args:
        watch: extra callables returning tensors to treat as device data at every step start.
    """

    def __init__(self, watch: Callable[[], Any] | None = None) -> None:
        self.watch = watch
        self.step = -1
        """Index of the step being run (-1: before the first)."""
        self.reads: dict[int, list[str]] = {}
        """Step -> one entry per read: 'what at file:line (function)'."""
        self.counts: dict[int, Counter[str]] = {}
        self._tracker: _DeviceTracker | None = None
        self._patches: list[tuple[Any, str, Any]] = []

    # ---------------------------------------------------------------- recording
    def _read(self, what: str) -> None:
        # any thread the mode reaches counts: autograd carries it into its worker threads (a DDP communication hook
        # that reads a value there stalls the backward pass); our own background threads never run under it
        where = _caller()
        if where is not None:
            self.reads.setdefault(self.step, []).append(f"{what} at {where}")

    def _count(self, what: str) -> None:
        self.counts.setdefault(self.step, Counter())[what] += 1

    # ----------------------------------------------------------------- patches
    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        self._patches.append((owner, name, original))
        setattr(owner, name, make(original))

    def _install(self) -> None:
        tracker = self._tracker
        assert tracker is not None
        counter = self

        def on_device(original: Any, what: str, cond: Callable[..., bool] = lambda *a, **k: True) -> Any:
            def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
                if not (tracker.is_device(self) and cond(*args, **kwargs)):
                    return original(self, *args, **kwargs)
                counter._read(what)
                out = original(self, *args, **kwargs)
                if out is self:  # on a GPU the host copy is a new tensor, not the device one
                    with _disable_current_modes():
                        out = self.clone()
                return out

            return wrapper

        def to_host(*args: Any, **kwargs: Any) -> bool:
            # only an explicit 'cpu' string: ``t.to(other.device)`` moves nothing on a GPU, and on this CPU run
            # the two cannot be told apart
            device = kwargs.get("device", args[0] if args else None)
            return isinstance(device, str) and device.startswith("cpu")

        self._patch(torch.Tensor, "tolist", lambda f: on_device(f, "Tensor.tolist"))
        self._patch(torch.Tensor, "numpy", lambda f: on_device(f, "Tensor.numpy"))
        self._patch(torch.Tensor, "cpu", lambda f: on_device(f, "Tensor.cpu"))
        self._patch(torch.Tensor, "to", lambda f: on_device(f, "Tensor.to('cpu')", to_host))

        def host_values(args: tuple[Any, ...], kwargs: dict[str, Any], many: bool) -> int:
            value = args[1] if len(args) > 1 else kwargs.get("dictionary" if many else "value")
            values = list(value.values()) if many and isinstance(value, dict) else [value]
            return sum(not isinstance(v, torch.Tensor) for v in values)

        def logged(original: Any, many: bool) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                for _ in range(host_values(args, kwargs, many)):
                    counter._read("LightningModule.log of a host value (a device tensor on a GPU)")
                return original(*args, **kwargs)

            return wrapper

        self._patch(LightningModule, "log", lambda f: logged(f, False))
        self._patch(LightningModule, "log_dict", lambda f: logged(f, True))

        def synced(original: Any, what: str) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                counter._read(what)
                return original(*args, **kwargs)

            return wrapper

        def device_result(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                tracker.mark(out)
                return out

            return wrapper

        # a DDP bucket's buffer and gradient views are device memory that the reducer made outside any traced op
        import torch.distributed as dist

        self._patch(dist.GradBucket, "buffer", device_result)
        self._patch(dist.GradBucket, "gradients", device_result)
        # on a GPU a staged reading is a non-blocking copy: the CPU run takes the same path, not the host's shortcut
        from lightning_resilience import _staging

        self._patch(_staging, "READ_AT_ONCE", lambda f: frozenset())
        self._patch(torch.cuda, "synchronize", lambda f: synced(f, "torch.cuda.synchronize"))
        self._patch(torch.cuda.Event, "synchronize", lambda f: synced(f, "Event.synchronize"))
        self._patch(torch.cuda.Stream, "synchronize", lambda f: synced(f, "Stream.synchronize"))

    def _uninstall(self) -> None:
        while self._patches:
            owner, name, original = self._patches.pop()
            setattr(owner, name, original)

    @contextmanager
    def active(self) -> Iterator[HostSyncCounter]:
        """Count inside the block (outside Lightning, e.g. around a plain training loop)."""
        self._tracker = _DeviceTracker(self)
        self._install()
        try:
            with self._tracker:
                yield self
        finally:
            self._uninstall()
            self._tracker = None

    def mark_device(self, tensors: Any) -> None:
        """Treat ``tensors`` (any nesting) as device data."""
        if self._tracker is not None:
            self._tracker.mark(tensors)

    def begin_step(self, step: int, *device: Any) -> None:
        self.step = step
        for tensors in device:
            self.mark_device(tensors)
        if self.watch is not None:
            self.mark_device(self.watch())

    # ----------------------------------------------------------------- Lightning
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._context = self.active()
        self._context.__enter__()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        state = [list(pl_module.parameters()), list(pl_module.buffers()), batch]
        for opt in trainer.optimizers:
            state.append([v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
        self.begin_step(trainer.global_step, *state)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.step = -2  # after the last step (final persist, report)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        context = getattr(self, "_context", None)
        if context is not None:
            self._context = None
            context.__exit__(None, None, None)

    # ------------------------------------------------------------------- report
    def report(self) -> dict[str, Any]:
        """JSON-able: reads per step (-1 before the first step, -2 after the last), where they came from, counts."""
        return {
            "reads_per_step": {str(s): len(r) for s, r in sorted(self.reads.items())},
            "reads": {str(s): r for s, r in sorted(self.reads.items())},
            "counts": {str(s): dict(c) for s, c in sorted(self.counts.items())},
        }


@contextmanager
def cuda_sync_calls() -> Iterator[list[str | None]]:
    """Under ``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing CUDA call made in the block, as the
    ``file:line`` of our code that made it (None: not ours), in order. A GPU-only counterpart of the counter."""
    import warnings

    found: list[str | None] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        original = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            if "synchroniz" in str(message):
                found.append(_caller())
            else:
                original(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
