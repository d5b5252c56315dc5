"""Background snapshot copies overlap the next step, and the optimizer step waits for them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch

from lightning_resilience.checkpoint import host_copy
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier


class GatedCopier:
    """Copies only once the test opens the gate, so "the copy is still in flight" is a state, not a race."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.copied = threading.Event()

    def submit(self, job: host_copy.CopyJob) -> host_copy.CopyJob:
        def run() -> None:
            self.gate.wait(30)
            for dst, src in job.pairs:
                dst.copy_(src)
            self.copied.set()
            job.sealed = True
            for callback in job.then:
                callback()
            job.done.set()

        threading.Thread(target=run, daemon=True).start()
        return job

    def then(self, job: host_copy.CopyJob, callback: Callable[[], None]) -> None:
        job.then.append(callback)

    def close(self, timeout: timedelta) -> None:
        self.gate.set()


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, CheckpointManager, GatedCopier]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    manager = CheckpointManager([MemoryTier(every_n_steps=1, keep=1)])
    manager.setup()
    copier = GatedCopier()
    manager._pool._copier = copier  # type: ignore[assignment]
    return model, opt, manager, copier


def _param_storages(model: torch.nn.Module, opt: torch.optim.Optimizer) -> set[int]:
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ptrs |= {v.untyped_storage().data_ptr() for st in opt.state.values() for v in st.values()}
    return ptrs


def test_optimizer_step_waits_for_the_inflight_copy() -> None:
    """With a copy in flight, optimizer.step blocks; once it lands, the snapshot holds the pre-step values."""
    model, opt, manager, copier = _setup()
    guard = manager.guard_optimizer(opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ptrs = _param_storages(model, opt)
    manager.on_step(1, lambda: {"model": model.state_dict()}, overlap=lambda t: t.untyped_storage().data_ptr() in ptrs)

    model(torch.randn(4, 8)).sum().backward()  # the next step's compute overlaps the copy
    stepped = threading.Event()
    worker = threading.Thread(target=lambda: (opt.step(), stepped.set()), daemon=True)
    worker.start()
    assert not stepped.wait(0.3), "optimizer.step ran while the snapshot copy was still reading the parameters"
    copier.gate.set()
    assert stepped.wait(30)
    worker.join(30)

    restored = manager.restore()
    assert restored is not None and restored.step == 1
    for k, v in before.items():
        assert torch.equal(restored.state["model"][k], v), k
    assert not torch.equal(model[0].weight, before["0.weight"])  # the step did happen afterwards
    guard.remove()
    manager.close()


def test_tensors_the_forward_pass_changes_are_copied_at_once() -> None:
    """BatchNorm running stats change in forward: they are copied synchronously, never deferred."""
    model, opt, manager, copier = _setup()
    ptrs = _param_storages(model, opt)
    stats_before = model[1].running_mean.clone()
    manager.on_step(1, lambda: {"model": model.state_dict()}, overlap=lambda t: t.untyped_storage().data_ptr() in ptrs)
    model(torch.randn(4, 8) * 5)  # forward in train mode updates running_mean while the copy is gated
    assert not torch.equal(model[1].running_mean, stats_before)
    copier.gate.set()
    restored = manager.restore()
    assert restored is not None
    assert torch.equal(restored.state["model"]["1.running_mean"], stats_before)
    manager.close()
