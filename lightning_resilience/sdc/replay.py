"""Dual-run replay: recompute a step's forward and backward on the same batch with the same RNG state and digest
the local gradients it produces, without disturbing the gradients already computed.

Under DDP the gradients on the parameters after backward are already averaged over ranks, so the local
contribution is digested on the way into the all-reduce by a communication hook (:class:`BucketFingerprintHook`),
and replays run without gradient synchronisation.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_resilience._staging import to_host
from lightning_resilience.sdc.fingerprint import Digest, digest_all

__all__ = ["BucketFingerprintHook", "GradientReplayer", "RngState", "capture_rng", "map_tensors", "rng_as"]

RngState = dict[str, torch.Tensor]


def capture_rng() -> RngState:
    """The torch generator states a training step draws from (CPU, and the current CUDA device if in use)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


@contextlib.contextmanager
def rng_as(state: RngState) -> Iterator[None]:
    """Run the body with the generators set to ``state``; they are put back as they were afterwards."""
    devices = [torch.cuda.current_device()] if "cuda" in state and torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state["cpu"])
        if devices:
            torch.cuda.set_rng_state(state["cuda"])
        yield


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        items = [map_tensors(v, fn) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj


@dataclass
class BucketFingerprintHook:
    """DDP communication hook state: digest each parameter's gradient in a bucket before the bucket's all-reduce,
    then all-reduce it (average).

    Register with ``ddp_model.register_comm_hook(state, state.comm_hook)``. Digests are taken only while
    :attr:`enabled` (the monitor turns it on for the steps whose gradients a replay will compare) and stay on the
    device; after a synchronised backward, :meth:`collected` reads one digest per parameter of what this rank
    contributed to the host (one read).
    """

    params: Sequence[torch.nn.Parameter]
    digest: Digest
    process_group: Any = None
    enabled: bool = True
    digests: dict[int, torch.Tensor] = field(default_factory=dict)
    """Parameter index -> digest of its local gradient (on the gradient's device)."""
    calls: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self._index = {id(p): i for i, p in enumerate(self.params)}

    def reset(self) -> None:
        self.digests = {}

    @property
    def comm_hook(self) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
        return _fingerprint_then_allreduce

    def collected(self) -> torch.Tensor:
        """Per-parameter digests of the last synchronised backward (``[len(params), width]`` on the host; zeros: no
        gradient)."""
        zero = self.digest.compute(None)
        return to_host([self.digests.get(i, zero) for i in range(len(self.params))])


def _fingerprint_then_allreduce(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    if state.enabled:
        start = time.perf_counter()
        state.calls += 1
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            state.digests[state._index[id(param)]] = state.digest.compute(grad)
        state.seconds += time.perf_counter() - start
    return _scale_then_allreduce(state.process_group, bucket)


def _scale_then_allreduce(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # DDP's built-in path multiplies by 1/world_size while filling the bucket, then sums; doing exactly that keeps
    # the averaged gradients bitwise equal to a run without the hook (dividing rounds differently)
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.mul_(1.0 / dist.get_world_size(group))
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()

    def first(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return f.value()[0]

    return fut.then(first)


# DDP checks the hook's annotations as objects; postponed (string) annotations would fail that check
_fingerprint_then_allreduce.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


class GradientReplayer:
    """Recomputes local gradients of a batch and digests them, leaving the parameters' ``.grad`` as they were.

    Args:
        params: the trainable parameters (their order defines digest rows).
        loss_fn: the step's forward: ``loss_fn(batch) -> loss`` (a scalar tensor).
        digest: how gradients are digested.
        no_sync: context manager that turns off gradient synchronisation (DDP's ``no_sync``), or None.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        loss_fn: Callable[[Any], torch.Tensor],
        digest: Digest,
        no_sync: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        self.params = list(params)
        self.loss_fn = loss_fn
        self.digest = digest
        self.no_sync = no_sync or contextlib.nullcontext
        self.replays = 0

    def local_digests(self) -> torch.Tensor:
        """Digests of the gradients on the parameters now (``[len(params), width]``)."""
        return digest_all(self.digest, [p.grad for p in self.params])

    def replay(self, batch: Any, rng: RngState) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Forward and backward of ``batch`` under ``rng``; returns the per-parameter digests and the gradients."""
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            with rng_as(rng), self.no_sync(), torch.enable_grad():
                loss = self.loss_fn(batch)
                loss.backward()
            grads = [p.grad for p in self.params]
        finally:
            for p, g in zip(self.params, saved):
                p.grad = g
        self.replays += 1
        return digest_all(self.digest, grads), grads
