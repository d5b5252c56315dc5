"""A plain Lightning user script, as a new user writes it, with the callbacks of the default preset added in code.

What the user wrote (``main`` down to ``trainer.fit``): a map-style dataset whose items draw random augmentation,
``DataLoader(dataset, batch_size=8, shuffle=True, num_workers=W)``, a module with dropout and ``torch.randn`` noise
in ``training_step``, SGD with a ``StepLR`` scheduler, ``Trainer(strategy="ddp", devices=2)`` on CPU with gloo, and
the callbacks of ``resilience=default`` (tiered checkpoint to RAM and local disk, straggler detection, SDC guards,
watchdog and preemption handling). Lightning injects its ``DistributedSampler``; nothing in the script is ours but
the callbacks. ``_env_script.py`` is the same script with the suite switched on by the environment instead.

The drill harness (``tests/drills/_harness.py``) adds the fault (``tests/drills/_user_code.py`` lists them). Every
attempt of every rank writes ``RUN/reports/launch<L>_attempt<N>_rank<R>.json`` (restored step, final step); rank 0
of an attempt that reaches ``--steps`` writes the final weights to ``RUN/weights.pt``. A decided stop (a
preemption) ends the process with the suite's code, for the launcher to restart.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader

from lightning_resilience import DecidedExit, LocalTier, Suite, TieredCheckpoint
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.config.registry import register_configs
from lightning_resilience.lightning.suite import build_suite
from tests.drills._train_script import _StallingSnapshot
from tests.drills._user_code import AugmentedPoints, Fault, Regressor, drill_callbacks, parse, save_weights

ROOT = Path(__file__).resolve().parents[2]


def default_preset_callbacks(run_dir: Path) -> list[Callback]:
    """The callbacks of ``resilience=default``, composed and built the way the recipes do it."""
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("pretrain_gpt", overrides=[f"run_dir={run_dir}", "resilience=default"])
    return build_suite(cfg.resilience)


def arm_persist_stall(fault: Fault, callbacks: list[Callback]) -> None:
    """Make the local tier's write of the fault's step stall after its data files, before its manifest."""
    tiered = next(c for c in callbacks if isinstance(c, TieredCheckpoint))
    local = next(t for t in tiered.tiers if isinstance(t, LocalTier))
    write, step, stalled = local.write, fault.step, fault.in_flight

    def stalling_write(snap: StagedSnapshot) -> None:
        write(_StallingSnapshot(snap, stalled) if snap.step == step else snap)

    local.write = stalling_write  # type: ignore[method-assign]


def _restored(trainer: Trainer) -> int | None:
    checkpoint = Suite.of(trainer).checkpoint
    return checkpoint.stats.restored_step if checkpoint is not None else None


def main(argv: list[str]) -> int:
    args = parse(argv, __doc__.splitlines()[0])
    # ---- the user's script
    seed_everything(args.seed)
    loader = DataLoader(AugmentedPoints(), batch_size=8, shuffle=True, num_workers=args.workers)
    model = Regressor()
    callbacks = default_preset_callbacks(args.run_dir)
    # ---- the drill's additions
    extra = drill_callbacks(args, _restored)
    stall = [f for f in extra if isinstance(f, Fault) and f.kind == "sigkill-persist"]
    if stall and int(os.environ.get("RANK", "0")) == stall[0].rank:
        arm_persist_stall(stall[0], callbacks)
    # ---- the user's script
    trainer = Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp",
        callbacks=[*callbacks, *extra],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(args.run_dir),
    )
    try:
        trainer.fit(model, loader)
    except DecidedExit as decided:  # a decided stop: the process group goes first, then the exit
        return int(decided.exit_code)
    save_weights(trainer, model, args)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if torch.distributed.is_initialized():
        # an explicit teardown: left to interpreter exit, gloo's threads can abort the process (SIGABRT)
        torch.distributed.destroy_process_group()
    sys.exit(code)
