"""Collective-wait probes on 2 real gloo ranks: under DDP (with and without a communication hook of its own) and
FSDP2, the rank that waits for a slower one has the wait, not the compute; ``compute`` names the slow rank.

Rank 1 stalls for ``STALL_S`` per step (a deterministic wait, so the figures do not depend on the machine's load),
either inside its step before the forward or between forward and backward."""

from __future__ import annotations

import statistics
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_resilience.checkpoint.determinism import ordered_allreduce_hook
from lightning_resilience.straggler import COMPUTE, STEP, WAIT, StepTimer, WaitProbe
from tests._ranks import run_ranks

pytestmark = pytest.mark.timeout(150)

STALL_S = 0.3  # large against the CPU work of these tiny steps, even on a loaded machine
STEPS = 7


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU())
    model.register_buffer("scale", torch.ones(1))  # DDP broadcasts buffers before every forward
    return model


def _train(model: torch.nn.Module, rank: int, where: str) -> dict[str, Any]:
    timer = StepTimer()
    probe = WaitProbe(timer)
    parallelism = probe.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 64)
    for _ in range(STEPS):
        timer.start_step()
        if rank == 1 and where == "before_forward":
            threading.Event().wait(STALL_S)
        loss = model(x).square().mean()
        if rank == 1 and where == "before_backward":
            threading.Event().wait(STALL_S)
        probe.arm_backward(loss)
        loss.backward()
        probe.backward_done()
        opt.step()
        opt.zero_grad()
        timer.end_step()
    probe.detach()
    records = timer.collect()[1:]  # the first step builds buckets and groups
    return {
        "parallelism": parallelism,
        **{k: statistics.median(r.get(k, 0.0) for r in records) for k in (STEP, WAIT, COMPUTE)},
    }


def _ddp(rank: int, world: int, tmp: Path, where: str, hook: bool) -> dict[str, Any]:
    ddp = DistributedDataParallel(_model())
    if hook:  # a communication hook of its own: the probe needs none and composes with any
        ddp.register_comm_hook(state=None, hook=ordered_allreduce_hook)
    return _train(ddp, rank, where)


class _Headed(torch.nn.Module):
    """The test model with a last layer (the parameter the DDP probe hooks) that step ``SKIP_HEAD_AT`` leaves out."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()
        self.head = torch.nn.Linear(64, 64)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.body(x)
        return y if self.calls - 1 == SKIP_HEAD_AT else self.head(y)


SKIP_HEAD_AT = 3


def _ddp_unused_head(rank: int, world: int, tmp: Path, ignored: list[str]) -> dict[str, Any]:
    """Rank 1 stalls before every backward; one step's backward reaches no gradient of the hooked parameter."""
    model = _Headed()
    model._ddp_params_and_buffers_to_ignore = ignored  # DDP's own switch: these stay out of its buckets
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    timer = StepTimer()
    probe = WaitProbe(timer)
    probe.attach(ddp)
    x = torch.randn(16, 64)
    for _ in range(STEPS):
        timer.start_step()
        loss = ddp(x).square().mean()
        if rank == 1:
            threading.Event().wait(STALL_S)
        probe.arm_backward(loss)
        loss.backward()
        probe.backward_done()
        timer.end_step()
    probe.detach()
    return {"waits": [r.get(WAIT, 0.0) for r in timer.collect()]}


def test_ddp_probe_goes_on_from_the_loss_after_a_step_without_its_parameter(tmp_path: Path) -> None:
    """The hooked parameter's gradient queues the wait's start; the step that has none leaves its wait unmeasured,
    and every step after it is measured again, from a hook on the loss."""
    waits = run_ranks(_ddp_unused_head, 2, tmp_path, [])[0]["waits"]
    measured = [w >= 0.7 * STALL_S for w in waits]
    assert measured[1:SKIP_HEAD_AT] == [True] * (SKIP_HEAD_AT - 1), waits  # from the parameter (step 0 builds)
    assert not measured[SKIP_HEAD_AT], waits  # no gradient of the hooked parameter: the wait went unmeasured
    assert all(measured[SKIP_HEAD_AT + 1 :]), waits  # from the loss


def test_ddp_probe_marks_from_the_loss_when_ddp_leaves_parameters_out(tmp_path: Path) -> None:
    """A parameter DDP leaves out of its buckets may get its gradient after DDP has queued its own callback: with
    any such parameter the probe marks every backward's wait from the loss, including the step without the head."""
    waits = run_ranks(_ddp_unused_head, 2, tmp_path, ["body.0.bias"])[0]["waits"]
    assert all(w >= 0.7 * STALL_S for w in waits[1:]), waits


def _fsdp2(rank: int, world: int, tmp: Path, where: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out = _train(model, rank, where)
    dist.barrier()
    return out


def _assert_rank0_waits_for_rank1(results: list[dict[str, Any]], parallelism: str) -> None:
    fast, slow = results
    assert fast["parallelism"] == slow["parallelism"] == parallelism
    assert fast[WAIT] >= 0.7 * STALL_S, results  # the fast rank waited for the slow one, and it was measured
    assert slow[WAIT] <= fast[WAIT] - 0.5 * STALL_S, results
    assert slow[COMPUTE] - fast[COMPUTE] >= 0.5 * STALL_S, results  # compute names the slow rank
    assert abs(fast[STEP] - slow[STEP]) <= 0.5 * STALL_S, results  # while the step is (nearly) the same


@pytest.mark.parametrize("where", ["before_forward", "before_backward"])
def test_ddp_wait_is_taken_out_of_compute(tmp_path: Path, where: str) -> None:
    _assert_rank0_waits_for_rank1(run_ranks(_ddp, 2, tmp_path, where, False), "ddp")


def test_ddp_probe_composes_with_a_communication_hook(tmp_path: Path) -> None:
    _assert_rank0_waits_for_rank1(run_ranks(_ddp, 2, tmp_path, "before_backward", True), "ddp")


@pytest.mark.parametrize("where", ["before_forward", "before_backward"])
def test_fsdp2_wait_is_taken_out_of_compute(tmp_path: Path, where: str) -> None:
    _assert_rank0_waits_for_rank1(run_ranks(_fsdp2, 2, tmp_path, where), "fsdp")


def test_no_wrapper_no_wait() -> None:
    result = _train(_model(), 0, "none")
    assert result["parallelism"] == "none" and result[WAIT] < 0.01
