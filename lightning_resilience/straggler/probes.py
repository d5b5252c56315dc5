"""Collective-wait probes: mark, inside a step, the spans a rank spends blocked on the other ranks.

Under data parallelism the gradient all-reduce makes every rank's step as long as the slowest one's: the fast ranks
wait. Telling the slow rank apart needs the wait taken out of the step, leaving each rank's own work
(``compute = step - wait``). The probes mark these spans as the ``wait`` section of the step timer:

* **backward**: during backward the probe queues an autograd *final callback*; the engine runs it once the whole
  graph has executed (all local gradients computed) and before the callbacks that DDP and FSDP queue later in the
  pass, which block until their gradient collectives are done. The wait is from that callback to the return of
  backward (:meth:`WaitProbe.backward_done`). Under DDP the callback is queued from a hook registered once, at
  attach, on one trainable parameter (it runs as that gradient is accumulated: before DDP queues its own callback,
  which waits for the last bucket); nothing is registered per step (unless DDP leaves parameters out of its
  buckets or reduces them late: then from the loss, as under FSDP). A step in which that parameter gets no gradient
  (an unused parameter) leaves its wait unmeasured, and from then on the probe queues the callback from a pre-hook
  on each step's loss (what it does under FSDP, whose callback is queued at the start of backward, and with no
  wrapper). No communication hook is used, so the probe composes with any hook (ordered all-reduce, SDC
  fingerprints, compression).
* **forward**: a wrapper that syncs before running its module (DDP's buffer broadcast, FSDP1's unshard) is timed
  from a forward pre-hook on the wrapper to one on the wrapped module; an FSDP2 module from a pre-hook placed before
  FSDP's own pre-forward (which waits for the parameter all-gather) to one placed after it.
* **FSDP2 in backward**: FSDP2 hooks each module's outputs so that their gradients first unshard the parameters
  again (and wait for that all-gather); gradient hooks on the same outputs, registered just before and just after
  FSDP's, bracket that wait.

Host marks come from the timer's source: with CUDA events the spans are device time (recorded on the current
stream, never waited for), so a wait the device spends on a collective is measured as the device sees it.

Left in ``compute``: collectives the probes cannot see, e.g. a ``self.log(..., sync_dist=True)`` inside the
forward, FSDP1's unshard inside backward, tensor-parallel collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from lightning_resilience.straggler.timing import WAIT, StepTimer

__all__ = ["WaitProbe", "find_parallelism"]

log = logging.getLogger(__name__)


def _fsdp2_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule  # type: ignore[no-any-return]


def _fsdp1_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return None
    return FullyShardedDataParallel


def find_parallelism(model: nn.Module) -> str:
    """``"ddp"``, ``"fsdp"`` (FSDP1 or FSDP2 modules inside ``model``) or ``"none"``."""
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    kinds = tuple(t for t in (_fsdp2_module_type(), _fsdp1_module_type()) if t is not None)
    if kinds and any(isinstance(m, kinds) for m in model.modules()):
        return "fsdp"
    return "none"


class WaitProbe:
    """Marks collective waits on ``timer`` (section ``wait``); see the module docstring.

    Example (plain torch)::

        probe = WaitProbe(timer)
        probe.attach(ddp_model)
        timer.start_step()
        loss = ddp_model(batch)
        probe.arm_backward(loss)
        loss.backward()
        probe.backward_done()
        opt.step()
        timer.end_step()
    """

    def __init__(self, timer: StepTimer) -> None:
        self.timer = timer
        self.parallelism = "none"
        self._handles: list[Any] = []
        self._queue_callback: Callable[[Callable[[], None]], None] | None = _final_callback_queue()
        self._on_gradient: RemovableHandle | None = None  # the DDP parameter hook: armed per step, registered once
        self._armed = False
        """A backward is armed and its callback not yet queued (the parameter hook clears it when it queues)."""

    def attach(self, model: nn.Module) -> str:
        """Hook the waits of ``model``'s wrappers; returns what was found (:func:`find_parallelism`)."""
        self.detach()
        self.parallelism = find_parallelism(model)
        fsdp2, fsdp1 = _fsdp2_module_type(), _fsdp1_module_type()
        if isinstance(model, DistributedDataParallel):
            self._pair_around(model, model.module)
            if not model.parameters_to_ignore:  # parameters DDP leaves out or reduces late: the loss's pre-hook
                self._hook_a_gradient(model.module)
        for module in model.modules():
            if fsdp2 is not None and isinstance(module, fsdp2):
                self._handles.append(module.register_forward_pre_hook(self._enter, prepend=True))
                self._handles.append(module.register_forward_pre_hook(self._leave))
                # FSDP2's post-forward hooks the outputs' gradients to unshard for backward (and wait for it):
                # gradient hooks on the same outputs, one registered before FSDP's and one after, bracket that wait
                self._handles.append(module.register_forward_hook(self._bracket_backward_enter, prepend=True))
                self._handles.append(module.register_forward_hook(self._bracket_backward_leave))
            elif fsdp1 is not None and isinstance(module, fsdp1):
                inner = module.module  # FSDP1 unshards in forward, then calls the wrapped module
                assert isinstance(inner, nn.Module)
                self._pair_around(module, inner)
        return self.parallelism

    def _pair_around(self, wrapper: nn.Module, inner: nn.Module) -> None:
        self._handles.append(wrapper.register_forward_pre_hook(self._enter, prepend=True))
        self._handles.append(inner.register_forward_pre_hook(self._leave))

    def _hook_a_gradient(self, module: nn.Module) -> None:
        """Queue the backward's callback from the accumulation of one trainable parameter's gradient (the last
        registered: usually the output layer's, the first gradient of the pass)."""
        trainable = [p for p in module.parameters() if p.requires_grad]
        if not trainable or self._queue_callback is None:
            return
        self._on_gradient = trainable[-1].register_post_accumulate_grad_hook(self._gradient_accumulated)
        self._handles.append(self._on_gradient)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._on_gradient, self._armed = None, False

    def _enter(self, *_: Any) -> None:
        if self.timer.in_step and not self.timer.is_open(WAIT):
            self.timer.begin(WAIT)

    def _leave(self, *_: Any) -> None:
        self.timer.end(WAIT)

    def _bracket_backward_enter(self, module: nn.Module, args: Any, output: Any) -> None:
        _on_output_grads(output, self._enter)

    def _bracket_backward_leave(self, module: nn.Module, args: Any, output: Any) -> None:
        _on_output_grads(output, self._leave)

    def arm_backward(self, loss: torch.Tensor) -> None:
        """Call just before ``loss.backward()``: the wait opens once the local gradients are all computed."""
        if self._queue_callback is None or not self.timer.in_step:
            return
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
            return
        if self._on_gradient is not None:  # DDP: the parameter hook queues the callback; nothing to register
            self._armed = True
            return
        if loss.grad_fn is None:
            return
        # a pre-hook on the loss's node (the first the engine runs), no closure: on a CPU whose caches the step has
        # evicted, a tensor hook with a new closure costs about 80 us, this about 50
        loss.grad_fn.register_prehook(self._backward_started)

    def _backward_started(self, grad_outputs: Any) -> None:
        assert self._queue_callback is not None
        self._queue_callback(self._enter)  # after the graph, before DDP's/FSDP's final callbacks (queued later)

    def _gradient_accumulated(self, parameter: torch.Tensor) -> None:
        if self._armed:
            self._armed = False
            assert self._queue_callback is not None
            self._queue_callback(self._enter)

    def backward_done(self) -> None:
        """Call when backward has returned (gradient collectives done): the wait closes."""
        if self._armed:  # the hooked parameter got no gradient in this pass: its wait went unmeasured
            self._armed = False
            self._from_the_loss()
        self.timer.end(WAIT)

    def _from_the_loss(self) -> None:
        """From the next backward on, queue the callback from a pre-hook on each step's loss."""
        assert self._on_gradient is not None
        self._on_gradient.remove()
        self._handles.remove(self._on_gradient)
        self._on_gradient = None
        log.info("straggler: a parameter the probe hooked got no gradient: the backward's wait is marked from the loss")


def _on_output_grads(output: Any, fn: Callable[[], None]) -> None:
    """Call ``fn`` when the gradient of each tensor of ``output`` that needs one arrives (only under grad mode)."""
    if not torch.is_grad_enabled():
        return
    for t in tree_flatten(output)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda grad: fn())


def _final_callback_queue() -> Callable[[Callable[[], None]], None] | None:
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:  # pragma: no cover - every torch >= 1.x has it (DDP and FSDP rely on it)
        log.warning("straggler: torch has no autograd final callbacks: the backward collective wait is not measured")
    return queue
