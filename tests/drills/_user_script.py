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

import argparse
import errno
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch import Callback, LightningDataModule, Trainer, seed_everything
from torch.utils.data import DataLoader

from lightning_resilience import DecidedExit, LocalTier, MemoryTier, RemoteTier, Suite, TieredCheckpoint
from lightning_resilience.checkpoint import host_copy
from lightning_resilience.checkpoint.layout import parse_step
from lightning_resilience.checkpoint.shared_memory import held_steps, rank_directory, resolve_run_key
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tier import Written
from lightning_resilience.checkpoint.tree import TensorSpec
from lightning_resilience.collective import Deadline, set_fault_hook
from lightning_resilience.config.registry import register_configs
from lightning_resilience.lightning.suite import build_suite
from tests.drills._s3_outage import CONTROL_ENV, ENDPOINT_ENV, committed_in_store, request_outage, storage_overrides
from tests.drills._train_script import _StallingSnapshot
from tests.drills._user_code import (
    OVERRIDES_ENV,
    PERSIST_EVERY,
    AugmentedPoints,
    Fault,
    Regressor,
    drill_callbacks,
    parse,
    record_fault,
    save_weights,
)

ROOT = Path(__file__).resolve().parents[2]


def default_preset_callbacks(run_dir: Path, checkpoint: str = "local") -> list[Callback]:
    """The callbacks of ``resilience=default``, composed and built the way the recipes do it; ``checkpoint=tiered``
    swaps in the tiered checkpoint preset (a peer tier), each of the 2 ranks standing for a node of its own."""
    register_configs()
    overrides = [f"run_dir={run_dir}", "resilience=default"]
    if checkpoint == "tiered":
        overrides += ["resilience/checkpoint=tiered", "+resilience.checkpoint.tiers.1.ranks_per_node=1"]
    elif checkpoint == "s3":
        overrides += storage_overrides(os.environ[ENDPOINT_ENV], run_dir.name, PERSIST_EVERY)
    overrides += os.environ.get(OVERRIDES_ENV, "").split()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("pretrain_gpt", overrides=overrides)
    return build_suite(cfg.resilience)


SETTLE_LIMIT = timedelta(seconds=60)  # a persist of the drill's tiny model takes well under a second
HANG_LIMIT_S = 600.0  # a hung rank outlives every deadline of the drill: the launcher ends it long before


class _FullDiskSnapshot(StagedSnapshot):
    """A snapshot whose writer finds the disk full after the data files are written, before the manifest."""

    def __init__(self, snap: StagedSnapshot) -> None:
        super().__init__(snap.step, snap.skeleton, snap.tensors, dict(snap.meta))

    def specs(self) -> dict[str, TensorSpec]:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "manifest.json")


def _local_tier(callbacks: list[Callback]) -> LocalTier:
    tiered = next(c for c in callbacks if isinstance(c, TieredCheckpoint))
    return next(t for t in tiered.tiers if isinstance(t, LocalTier))


def _memory_tier(callbacks: list[Callback]) -> MemoryTier:
    tiered = next(c for c in callbacks if isinstance(c, TieredCheckpoint))
    return next(t for t in tiered.tiers if isinstance(t, MemoryTier))


def arm_persist_stall(fault: Fault, callbacks: list[Callback]) -> None:
    """Make the local tier's write of the fault's step stall after its data files, before its manifest."""
    local = _local_tier(callbacks)
    write, step, stalled = local.write, fault.step, fault.in_flight

    def stalling_write(snap: StagedSnapshot, deadline: Deadline | None = None) -> Written:
        return write(_StallingSnapshot(snap, stalled) if snap.step == step else snap, deadline)

    local.write = stalling_write  # type: ignore[method-assign]


def arm_full_disk(fault: Fault, callbacks: list[Callback]) -> None:
    """Make the local tier's write of the persist step before the fault's step fail with ENOSPC half-way."""
    local = _local_tier(callbacks)
    write, step, failed = local.write, fault.step // PERSIST_EVERY * PERSIST_EVERY, fault.in_flight

    def full_disk_write(snap: StagedSnapshot, deadline: Deadline | None = None) -> Written:
        if snap.step != step:
            return write(snap, deadline)
        try:
            return write(_FullDiskSnapshot(snap), deadline)
        finally:
            failed.set()

    local.write = full_disk_write  # type: ignore[method-assign]


def arm_restore_kill(args: argparse.Namespace, callbacks: list[Callback]) -> None:
    """Make this rank die while it restores: SIGKILL once its shard of the restored step is read from the disk (before
    the ranks agree on it), or taken from the RAM tier (the node's shared memory, once they agreed)."""
    local, memory = _local_tier(callbacks), _memory_tier(callbacks)

    def dying(read: Callable[[int], StagedSnapshot]) -> Callable[[int], StagedSnapshot]:
        def dying_read(step: int) -> StagedSnapshot:
            snap = read(step)
            record_fault(args.run_dir, kind="sigkill-restore", rank=args.fault_rank, step=step, damaged=None)
            print(f"DRILL: rank {args.fault_rank} SIGKILL while restoring step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
            return snap

        return dying_read

    local.read = dying(local.read)  # type: ignore[method-assign,assignment]
    memory.take = dying(memory.take)  # type: ignore[method-assign,assignment]


def arm_peer_send_kill(args: argparse.Namespace) -> None:
    """Make this rank die as it starts sending its shard of peer step ``--fault-step`` to its peer (the peer tier's
    exchange of that step, on its side group)."""

    def dying_exchange(op: str, rank: int, step: int | None) -> None:
        if op == "peer.exchange" and step == args.fault_step:
            record_fault(args.run_dir, kind="sigkill-peer-send", rank=rank, step=step, damaged=None)
            print(f"DRILL: rank {rank} SIGKILL sending step {step} to its peer", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    set_fault_hook(dying_exchange)


def arm_store_outage(args: argparse.Namespace, callbacks: list[Callback]) -> None:
    """Have the S3 server killed as this rank starts uploading the persist step before ``--fault-step``; it comes back
    1 to 3 s later, within the remote tier's retries."""
    tiered = next(c for c in callbacks if isinstance(c, TieredCheckpoint))
    remote = next(t for t in tiered.tiers if isinstance(t, RemoteTier))
    upload, step = remote._upload, args.fault_step // PERSIST_EVERY * PERSIST_EVERY
    seconds, pending = 1 + args.fault_step % 3, [True]

    def upload_through_outage(local: Path, key: str) -> None:
        uploading = parse_step(key.split("/")[-3])  # <prefix>/step_.../rank_.../<file>
        # a persist that finds the previous one still running is deferred to a later step: the first one from P on
        if pending and uploading is not None and uploading >= step:
            pending.clear()
            record_fault(args.run_dir, kind="s3-outage", rank=args.fault_rank, step=uploading, phase="outage")
            print(f"DRILL: rank {args.fault_rank} S3 down for {seconds} s uploading step {uploading}", flush=True)
            request_outage(os.environ[CONTROL_ENV], seconds)
        upload(local, key)

    remote._upload = upload_through_outage  # type: ignore[method-assign,assignment]


def arm_collective_hang(args: argparse.Namespace) -> None:
    """Make this rank block inside the step agreement of the step after ``--fault-step`` (its agreement thread)."""

    def hang(op: str, rank: int, step: int | None) -> None:
        if op == "step.agree" and step == args.fault_step + 1:
            record_fault(args.run_dir, kind="hang-collective", rank=rank, step=args.fault_step, damaged=None)
            print(f"DRILL: rank {rank} hangs in {op!r} of step {step}", flush=True)
            threading.Event().wait(HANG_LIMIT_S)

    set_fault_hook(hang)


def arm(args: argparse.Namespace, extra: list[Callback], callbacks: list[Callback]) -> None:
    """The faults that reach inside the library's tiers and side groups, on the rank they hit."""
    rank, attempt = int(os.environ.get("RANK", "0")), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fault = next((f for f in extra if isinstance(f, Fault)), None)
    if fault is not None:  # every rank settles: whether a persist is deferred is agreed across ranks
        tiered = next(c for c in callbacks if isinstance(c, TieredCheckpoint))
        fault.settle = lambda: tiered.manager is not None and tiered.manager.wait(SETTLE_LIMIT)
    if rank != args.fault_rank or args.launch != args.fault_launch:
        return
    if fault is not None and fault.kind in ("node-loss", "ram-loss", "s3-outage"):
        arm_ram_loss(fault, callbacks)
    if fault is not None and fault.kind == "sigkill-snapshot":
        arm_snapshot_stall(fault, extra)
    elif fault is not None and fault.kind == "sigkill-persist":
        arm_persist_stall(fault, callbacks)
    elif fault is not None and fault.kind == "enospc":
        arm_full_disk(fault, callbacks)
    elif args.fault == "sigkill-restore" and attempt == 1:
        arm_restore_kill(args, callbacks)
    elif args.fault == "hang-collective" and attempt == 0:
        arm_collective_hang(args)
    elif args.fault == "sigkill-peer-send" and attempt == 0:
        arm_peer_send_kill(args)
    elif args.fault == "s3-outage" and attempt == 0:
        arm_store_outage(args, callbacks)


def shared_memory(callbacks: list[Callback]) -> tuple[Path, str | None]:
    """Where the default preset's RAM tier keeps its snapshots on this node: its shm_dir, and this run's key."""
    memory = _memory_tier(callbacks)
    key = resolve_run_key(memory.config.run_id)
    return Path(memory.config.shm_dir), key[0] if key is not None else None


def held_in_shared_memory(callbacks: list[Callback]) -> dict[int, list[int]]:
    """Step -> ranks whose snapshot of it the node's shared memory holds whole (what a restart finds there)."""
    root, key = shared_memory(callbacks)
    return held_steps(root, key) if key is not None else {}


def arm_ram_loss(fault: Fault, callbacks: list[Callback]) -> None:
    """A lost node loses its RAM: this rank's snapshots in shared memory are deleted before it dies."""
    root, key = shared_memory(callbacks)
    rank = int(os.environ.get("RANK", "0"))
    if key is not None:
        fault.lose_ram = lambda: shutil.rmtree(rank_directory(root, key, rank), ignore_errors=True)


class _ArmAt(Callback):
    """Sets ``event`` as step ``step`` ends, before the checkpoint callback (Lightning runs it last) snapshots it."""

    def __init__(self, step: int, event: threading.Event) -> None:
        self.step, self.event = step, event

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.event.set()


def arm_snapshot_stall(fault: Fault, extra: list[Callback]) -> None:
    """Make the background copy of step ``--fault-step``'s snapshot stall after half of its tensors (the fault then
    kills the rank while that copy is in flight)."""
    copy_pairs, armed = host_copy.copy_pairs, threading.Event()

    def stalling(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if armed.is_set() and threading.current_thread().name == "lr-snapshot-copy":
            armed.clear()
            copy_pairs(pairs[: len(pairs) // 2])
            print(f"DRILL: the snapshot copy of step {fault.step} stalls half-way", flush=True)
            fault.in_flight.set()
            threading.Event().wait(HANG_LIMIT_S)
        copy_pairs(pairs)

    host_copy.copy_pairs = stalling  # type: ignore[assignment]
    extra.append(_ArmAt(fault.step, armed))


def _restored(trainer: Trainer) -> tuple[int | None, str | None]:
    checkpoint = Suite.of(trainer).checkpoint
    return (checkpoint.stats.restored_step, checkpoint.stats.restored_from) if checkpoint is not None else (None, None)


def main(argv: list[str]) -> int:
    args = parse(argv, __doc__.splitlines()[0])
    # ---- the user's script
    seed_everything(args.seed)
    loader = DataLoader(AugmentedPoints(), batch_size=8, shuffle=True, num_workers=args.workers)
    model = Regressor()
    callbacks = default_preset_callbacks(args.run_dir, args.checkpoint)
    # ---- the drill's additions
    elsewhere = [lambda: held_in_shared_memory(callbacks)]
    if args.checkpoint == "s3":
        endpoint = os.environ[ENDPOINT_ENV]
        elsewhere.append(lambda: committed_in_store(endpoint, args.run_dir.name))
    extra = drill_callbacks(args, _restored, *elsewhere)
    arm(args, extra, callbacks)
    # ---- the user's script
    return fit_and_save(user_trainer(args, [*callbacks, *extra]), model, loader, args)


def user_trainer(args: argparse.Namespace, callbacks: list[Callback]) -> Trainer:
    """The user's Trainer: DDP on the ranks torchrun started, on CPU."""
    return Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp",
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(args.run_dir),
    )


def fit_and_save(
    trainer: Trainer, model: torch.nn.Module, data: DataLoader[Any] | LightningDataModule, args: argparse.Namespace
) -> int:
    """Train on ``data`` (the train loader or a datamodule); the final weights are saved unless the suite decided to
    stop (then its exit code is returned)."""
    try:
        trainer.fit(model, data)
    except DecidedExit as decided:  # a decided stop: the process group goes first, then the exit
        return int(decided.exit_code)
    save_weights(trainer, model, args)
    return 0


def exit_with(code: int) -> NoReturn:
    """End the drill process with ``code`` after an explicit teardown of the process group: left to interpreter
    exit, gloo's threads can abort the process (SIGABRT)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    exit_with(main(sys.argv[1:]))
