"""SDC verification on a CUDA device: digests agree with the CPU, replays restore the CUDA RNG stream, and a
gradient flip on the device is caught and fixed in place (final weights bitwise equal to a clean run)."""

from __future__ import annotations

import pytest
import torch

from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.sdc.fingerprint import BitwiseDigest
from lightning_resilience.sdc.inject import BitFlipInjector, FlipSpec
from lightning_resilience.sdc.monitor import SDCMonitor
from lightning_resilience.sdc.replay import capture_rng, rng_as
from lightning_resilience.sdc.verdict import Diagnosis
from tests.sdc._loop import batches, make_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]


def test_digest_is_the_same_on_cuda_and_cpu() -> None:
    t = torch.randn(1000, 37)
    d = BitwiseDigest()
    assert d.equal(d.compute(t.cuda()), d.compute(t))


def test_rng_as_replays_cuda_dropout_and_restores_the_stream() -> None:
    torch.cuda.manual_seed(3)
    x = torch.ones(4096, device="cuda")
    state = capture_rng()
    first = torch.nn.functional.dropout(x, 0.5)
    after = capture_rng()
    with rng_as(state):
        again = torch.nn.functional.dropout(x, 0.5)
    assert torch.equal(first, again)
    assert torch.equal(capture_rng()["cuda"], after["cuda"])  # the training stream is where it was


def _train(plan: list[FlipSpec]) -> tuple[dict[str, torch.Tensor], SDCMonitor]:
    torch.use_deterministic_algorithms(True)
    model, opt = make_model()
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.cuda.manual_seed(5)
    monitor = SDCMonitor(list(model.named_parameters()), [opt], SDCConfig(replay_every_n_steps=1))
    monitor.setup()
    monitor.attach(model.compute_loss)
    injector = BitFlipInjector(model, [opt])
    for step, batch in enumerate(batches(0, 6)):
        batch = batch.cuda()
        injector.on_step(step, plan)
        monitor.begin_step(step, batch)
        loss = model.compute_loss(batch)
        monitor.observe_loss(loss)
        loss.backward()
        monitor.before_optimizer_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        monitor.after_optimizer_step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, monitor


def test_cuda_gradient_flip_is_fixed_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    clean, monitor = _train([])
    assert monitor.events == []
    flipped, monitor = _train([FlipSpec("grad", step=2, bit_class="exponent", seed=1)])
    assert [(e.verdict, e.action) for e in monitor.events] == [(Diagnosis.TRANSIENT, "recomputed")]
    for k in clean:
        assert torch.equal(flipped[k], clean[k]), k
