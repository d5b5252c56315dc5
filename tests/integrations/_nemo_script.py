"""End-to-end check of the NeMo bridge against a real NeMo (run with the interpreter of a venv holding
nemo-toolkit; NeMo pins its own Lightning, e.g. 2.4.0 for NeMo 3.0).

A tiny NeMo ``ModelPT`` is trained on CPU with NeMo's ``exp_manager`` (its ModelCheckpoint kept) and our callbacks
built from a ``resilience:`` section plus NeMo's own fault-tolerance and straggler keys:

1. ``native``: NeMo's ``exp_manager`` given those keys as they are; the error it raises is recorded.
2. ``reference``: an uninterrupted plain NeMo run.
3. ``crash``: the bridged run, which raises at step ``--crash-at``.
4. ``resume``: a new model with other initial weights and the same config; ``TieredCheckpoint`` restores it.

The result (JSON, ``--out``) holds what the test asserts on: the errors, the restored step and tier, whether the
resumed weights equal the reference bitwise, where NeMo logged, and what our callbacks recorded.

    python tests/integrations/_nemo_script.py --workdir /tmp/nemo-run --out /tmp/nemo-run/result.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from omegaconf import DictConfig

from lightning_resilience import ResumableDataLoader, TieredCheckpoint
from lightning_resilience.config.registry import register_configs
from lightning_resilience.integrations.nemo import resilience_callbacks, resilience_exit_code, translate_exp_manager
from lightning_resilience.lightning.callbacks.fault_tolerance import FaultTolerance
from lightning_resilience.lightning.callbacks.straggler import StragglerDetection

STEPS = 24  # 10 batches an epoch (conf/nemo_tiny.yaml): the crash and the resume fall inside an epoch
CONF = Path(__file__).resolve().with_name("conf")
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class CrashAt(Callback):
    """Raises at the end of a given global step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"injected crash at step {self.step}")


def _model_class() -> type:
    from nemo.core import ModelPT

    class TinyRegressor(ModelPT):  # type: ignore[misc]
        """An MLP with dropout on a shuffled synthetic regression set; NeMo builds its optimizer from ``cfg.optim``."""

        def __init__(self, cfg: DictConfig, trainer: Trainer | None = None) -> None:
            super().__init__(cfg=cfg, trainer=trainer)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
            )

        def setup_training_data(self, train_data_config: DictConfig) -> None:
            g = torch.Generator().manual_seed(int(train_data_config.seed))
            x = torch.randn(int(train_data_config.num_samples), 8, generator=g)
            y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(x.shape[0], 1, generator=g)
            data = torch.utils.data.TensorDataset(x, y)
            self._train_dl = ResumableDataLoader(data, batch_size=int(train_data_config.batch_size), shuffle=True)

        def setup_validation_data(self, val_data_config: DictConfig) -> None:
            self._validation_dl = None

        @classmethod
        def list_available_models(cls) -> list[Any]:
            return []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x), y)
            self.log("train_loss", loss)
            return loss

    return TinyRegressor


def _config(workdir: Path, name: str, *extra: str) -> DictConfig:
    """The NeMo config composed by Hydra with the override lines a user adds to a NeMo example script."""
    from hydra import compose, initialize_config_dir

    register_configs()  # what a training script does before Hydra composes (schemas of configs/resilience)
    overrides = [
        f"hydra.searchpath=[file://{CONFIGS}]",
        "+resilience=default",
        f"+run_dir={workdir / 'runs' / name}",
        f"name={name}",
        f"exp_manager.exp_dir={workdir / 'nemo_experiments'}",
        f"trainer.max_steps={STEPS}",
        # NeMo's own keys, taken over by the bridge
        "++exp_manager.create_fault_tolerance_callback=True",
        "++exp_manager.fault_tolerance.initial_rank_heartbeat_timeout=600",
        "++exp_manager.fault_tolerance.rank_heartbeat_timeout=300",
        "++exp_manager.fault_tolerance.safety_factor=4",
        "++exp_manager.fault_tolerance.max_subsequent_job_failures=2",
        "++exp_manager.create_straggler_detection_callback=True",
        "++exp_manager.straggler_detection_params.gpu_relative_perf_threshold=0.8",
        "++exp_manager.straggler_detection_params.num_gpu_perf_scores_to_log=3",
        # ours: local tier every 5 steps, FT ledger in NeMo's log dir, short straggler warm-up
        "resilience.checkpoint.tiers.1.every_n_steps=5",
        "resilience.ft.config.run_dir=null",
        "resilience.straggler.config.warmup_steps=2",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("nemo_tiny", overrides=overrides)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _native(workdir: Path) -> dict[str, str]:
    """What NeMo's exp_manager does with its own fault-tolerance / straggler keys."""
    from nemo.utils.exp_manager import exp_manager

    out: dict[str, str] = {}
    for key, other in (
        ("create_fault_tolerance_callback", "create_straggler_detection_callback"),
        ("create_straggler_detection_callback", "create_fault_tolerance_callback"),
    ):
        cfg = _config(workdir, f"native_{key}", f"++exp_manager.{other}=False")
        em = cfg.exp_manager
        trainer = Trainer(**cfg.trainer)
        try:
            exp_manager(trainer, em)
            out[key] = "no error"
        except Exception as err:  # the type and message are what is recorded
            out[key] = f"{type(err).__name__}: {err}"
    return out


def _nemo_resume_choice(workdir: Path, name: str) -> str | None:
    """The checkpoint NeMo itself would resume from with ``resume_if_exists`` left on (its ``*last.ckpt``)."""
    from nemo.utils.exp_manager import exp_manager

    cfg = _config(workdir, name)
    stripped, _ = translate_exp_manager(cfg.exp_manager)  # without resilience.checkpoint: resume_if_exists stays on
    trainer = Trainer(**cfg.trainer)
    exp_manager(trainer, stripped)
    return trainer.ckpt_path


def _run(workdir: Path, name: str, model_cls: type, *, bridged: bool, crash_at: int | None, seed: int) -> dict:
    from nemo.utils.exp_manager import exp_manager

    cfg = _config(workdir, name)
    if bridged:
        callbacks: list[Callback] = resilience_callbacks(cfg)
        stripped, _ = translate_exp_manager(cfg.exp_manager, resilience=cfg.resilience)
    else:
        callbacks = []
        stripped = cfg.exp_manager
        for key in ("create_fault_tolerance_callback", "create_straggler_detection_callback"):
            stripped[key] = False
    if crash_at is not None:
        callbacks.append(CrashAt(crash_at))
    seed_everything(seed)
    trainer = Trainer(**cfg.trainer, callbacks=callbacks)
    log_dir = exp_manager(trainer, stripped)
    model = model_cls(cfg=cfg.model, trainer=trainer)
    result: dict[str, Any] = {"log_dir": str(log_dir), "ckpt_path_after_exp_manager": trainer.ckpt_path}
    try:
        trainer.fit(model)
        result["error"] = None
    except RuntimeError as err:
        result["error"] = str(err)
    result["global_step"] = trainer.global_step
    result["callbacks"] = [type(cb).__name__ for cb in trainer.callbacks]
    result["ours"] = [type(cb).__name__ for cb in callbacks if type(cb).__module__.startswith("lightning_resilience")]
    ours = {type(cb).__name__: cb for cb in trainer.callbacks}
    tiered = ours.get("TieredCheckpoint")
    if isinstance(tiered, TieredCheckpoint) and tiered.manager is not None:
        stats = tiered.stats
        result["restored_step"] = stats.restored_step
        result["restored_from"] = stats.restored_from
        result["tier_writes"] = {n: t.writes for n, t in stats.tiers.items()}
    ft = ours.get("FaultTolerance")
    if isinstance(ft, FaultTolerance):
        result["ft_run_dir"] = str(ft.run_dir)
        result["ft_initial_timeouts_s"] = ft.config.initial_timeouts_s
        result["ft_safety_factor"] = ft.config.safety_factor
        ledger = ft.run_dir / "ft_ledger.json" if ft.run_dir is not None else None
        attempts = json.loads(ledger.read_text())["attempts"] if ledger is not None and ledger.is_file() else []
        result["ft_ledger_attempts"] = [
            {k: a[k] for k in ("index", "start_step", "last_step", "end_reason")} for a in attempts
        ]
    straggler = ours.get("StragglerDetection")
    if isinstance(straggler, StragglerDetection):
        result["straggler_min_slowdown"] = straggler.config.min_slowdown
        result["straggler_max_logged_ranks"] = straggler.max_logged_ranks
        result["straggler_gathers"] = straggler.detector.gathers if straggler.detector is not None else 0
    policy = ours.get("ResiliencePolicy")
    if policy is not None:
        result["policy_straggler_action"] = policy.config.straggler
    result["exit_code"] = resilience_exit_code(trainer)
    ckpt_dir = Path(str(log_dir)) / "checkpoints"
    result["nemo_checkpoints"] = sorted(p.name for p in ckpt_dir.glob("*.ckpt")) if ckpt_dir.is_dir() else []
    result["weights"] = _weights(model)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--crash-at", type=int, default=13)
    args = parser.parse_args()
    workdir: Path = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)  # NeMo writes a few files relative to the working directory

    import nemo

    model_cls = _model_class()
    native = _native(workdir)
    reference = _run(workdir, "reference", model_cls, bridged=False, crash_at=None, seed=7)
    crash = _run(workdir, "bridged", model_cls, bridged=True, crash_at=args.crash_at, seed=7)
    nemo_choice = _nemo_resume_choice(workdir, "bridged")
    resume = _run(workdir, "bridged", model_cls, bridged=True, crash_at=None, seed=99)

    ref_w, res_w = reference.pop("weights"), resume.pop("weights")
    crash.pop("weights")
    result = {
        "nemo_version": nemo.__version__,
        "lightning_version": lightning.__version__,
        "steps": STEPS,
        "crash_at": args.crash_at,
        "native": native,
        "nemo_resume_choice": nemo_choice,
        "reference": reference,
        "crash": crash,
        "resume": resume,
        "bitwise_equal": ref_w.keys() == res_w.keys() and all(torch.equal(ref_w[k], res_w[k]) for k in ref_w),
        "max_abs_diff": max(float((ref_w[k].float() - res_w[k].float()).abs().max()) for k in ref_w),
    }
    args.out.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
