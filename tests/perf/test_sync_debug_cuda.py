"""On a CUDA device: the default preset's step path never synchronizes with the device on an ordinary step.

* the engines (SDC guards with their read lag, the RAM + disk snapshot with the optimizer guard) in a plain loop
  under ``torch.cuda.set_sync_debug_mode("error")``: any synchronizing call raises;
* the ``resilience=default`` callbacks in a Lightning fit: every synchronizing call is recorded with the code that
  made it (``set_sync_debug_mode("warn")``); none may come from ``lightning_resilience`` on an ordinary step;
* with two GPUs, the host-sync count of ``tests/perf/test_host_syncs.py`` on NCCL DDP ranks.

Run by ``python -m benchmarks.gpu_check`` whenever a GPU machine is available; skipped without CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]

WARMUP = 3  # the first steps allocate (optimizer state, pinned snapshot buffers)
STEPS = 30


def test_engines_never_synchronize_under_sync_debug_error(tmp_path: Path) -> None:
    from lightning_resilience.checkpoint import CheckpointManager, LocalTier, MemoryTier
    from lightning_resilience.sdc.config import SDCConfig
    from lightning_resilience.sdc.monitor import SDCMonitor
    from recipes._gpt import TinyGPT, gpt_preset

    with torch.device("cuda"):
        model = TinyGPT(**gpt_preset("tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = SDCMonitor(list(model.named_parameters()), [opt], SDCConfig())  # the default: guards read late
    monitor.setup()
    monitor.attach(model.compute_loss)
    manager = CheckpointManager([MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path, every_n_steps=10)])
    manager.setup()
    guard = manager.guard_optimizer(opt)
    owned = {p.data_ptr() for p in model.parameters()}
    batches = [torch.randint(256, (8, 65), device="cuda") for _ in range(4)]
    try:
        for step in range(STEPS):
            if step == WARMUP:
                torch.cuda.set_sync_debug_mode("error")
            batch = batches[step % len(batches)]
            monitor.begin_step(step, batch)
            loss = model.compute_loss(batch)
            monitor.observe_loss(loss)
            loss.backward()
            monitor.before_optimizer_step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            monitor.after_optimizer_step()
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            manager.on_step(step + 1, lambda s=state: s, overlap=lambda t: t.data_ptr() in owned or t.dim() > 0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        guard.remove()
    manager.close()
    assert monitor.stats.guard_forced_reads == 0 and monitor.events == []


def _quiet_gpt() -> LightningModule:
    from recipes._gpt import TinyGPT, gpt_preset

    class QuietGPT(TinyGPT):
        """The recipe's model without ``self.log`` in the step: the user's own logging is the user's sync."""

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.compute_loss(batch)

    return QuietGPT(**gpt_preset("tiny"))


def _sdc(trainer: Trainer) -> Any:
    from lightning_resilience.lightning.callbacks.sdc import SDCVerification

    (sdc,) = [cb for cb in trainer.callbacks if isinstance(cb, SDCVerification)]  # type: ignore[attr-defined]
    return sdc


class _Recorder(Callback):
    def __init__(self) -> None:
        from tests._host_syncs import cuda_sync_calls

        self.calls: dict[int, list[str | None]] = {}
        self._context = cuda_sync_calls()
        self._found: list[str | None] | None = None
        self._seen = 0
        self._sdc: Any = None
        self._rounds = 0
        self.sdc_rounds: set[int] = set()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._sdc = _sdc(trainer)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == WARMUP:
            self._found = self._context.__enter__()
        if self._found is not None:
            self.calls[trainer.global_step] = self._found[self._seen :]
            self._seen = len(self._found)
        rounds = self._sdc.stats.replay_rounds + self._sdc.stats.reconcile_rounds
        if rounds != self._rounds:  # a replay or reconciliation ran since the last batch start: not an ordinary step
            self.sdc_rounds.add(trainer.global_step)
            self._rounds = rounds

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._found is not None:
            self._context.__exit__(None, None, None)
            self._found = None


def test_default_preset_callbacks_make_no_sync_on_ordinary_steps(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from lightning.pytorch.loggers import CSVLogger

    from lightning_resilience.config.registry import register_configs
    from lightning_resilience.lightning.suite import build_suite
    from recipes._data import SyntheticTokenDataModule
    from recipes.pretrain_gpt import CONFIG_DIR
    from tests.perf.test_host_syncs import MAX_READS_PER_DUE_STEP

    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("pretrain_gpt", overrides=["resilience=default", f"run_dir={tmp_path}"])
    recorder = _Recorder()
    trainer = Trainer(
        max_steps=STEPS,
        accelerator="gpu",
        devices=1,
        logger=CSVLogger(tmp_path / "logs"),
        log_every_n_steps=10,
        callbacks=[recorder, *build_suite(cfg.resilience)],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    data = SyntheticTokenDataModule(batch_size=8, num_samples=8 * (STEPS + 2), seq_len=64, vocab_size=256, seed=1)
    trainer.fit(_quiet_gpt(), datamodule=data)
    ours = {step: [c for c in calls if c is not None] for step, calls in recorder.calls.items()}
    assert len(recorder.calls) >= STEPS - WARMUP - 1
    # not ordinary: a step that ran an SDC replay or reconciliation (by cadence, for a guard that fired, or before a
    # persist), or one near an SDC event; a call is recorded at the next batch start, hence the margin
    sdc = _sdc(trainer)
    busy = recorder.sdc_rounds | {e.step for e in sdc.events}  # the rounds by cadence are among the counted ones
    near = {s + d for s in busy for d in range(-1, 3)}
    ordinary = {s: c for s, c in ours.items() if s not in near}
    assert len(ordinary) >= (STEPS - WARMUP) // 2, (sorted(near), sdc.events)
    assert not any(ordinary.values()), {s: c for s, c in ordinary.items() if c}
    assert all(len(ours.get(s, [])) <= MAX_READS_PER_DUE_STEP for s in near), {s: ours.get(s) for s in near}
    others = sum(len(c) for c in recorder.calls.values()) - sum(len(c) for c in ours.values())
    print(f"synchronizing calls outside our code (Lightning, torch): {others} over {len(recorder.calls)} steps")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for 2 NCCL ranks")
@pytest.mark.parametrize("preset", ["default", "full"])
def test_nccl_ddp_host_reads(tmp_path: Path, preset: str) -> None:
    from tests.perf.test_host_syncs import MAX_READS_PER_ORDINARY_STEP, _due, _run
    from tests.perf.test_host_syncs import STEPS as COUNT_STEPS

    for report in _run(preset, tmp_path, "trainer.accelerator=gpu"):
        due = _due(report["sdc"])
        ordinary = [s for s in range(COUNT_STEPS) if s not in due]
        reads = sum(len(report["reads"].get(str(s), [])) for s in ordinary)
        assert reads / len(ordinary) <= MAX_READS_PER_ORDINARY_STEP, report["reads"]
