"""``lightning-resilience ckpt``: list, verify, inspect and export checkpoints (and the ``verify``/``inspect``
shortcuts)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import uuid
from pathlib import Path
from typing import Any

from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.layout import parse_step, step_dirname
from lightning_resilience.cli._common import CliError, console, non_negative, progress
from lightning_resilience.cli._discovery import ShardRef, discover, one_shard, select

__all__ = ["add_parsers", "cmd_export", "cmd_inspect", "cmd_ls", "cmd_verify"]

_TORCH_SUFFIXES = (".ckpt", ".pt", ".pth")


def _when(created: float) -> str:
    if not created:
        return "-"
    return dt.datetime.fromtimestamp(created, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _verification(meta: dict[str, Any]) -> str:
    """The verification state a step was committed with (:mod:`lightning_resilience.checkpoint.certify`), and
    whether it carries a content print."""
    from lightning_resilience.checkpoint.certify import verification_of
    from lightning_resilience.checkpoint.content import CONTENT

    return verification_of(meta).value + (", content print" if CONTENT in meta else "")


def _rejected(root: Path, steps_with_shards: set[int]) -> dict[int, str]:
    """Step -> reason of the steps a verdict rejected in the tier at ``root`` (no shard of them left)."""
    from lightning_resilience.checkpoint.certify import TOMBSTONE
    from lightning_resilience.checkpoint.layout import step_dirs

    out = {}
    for step, step_dir in step_dirs(root).items():
        record = step_dir / TOMBSTONE
        if step not in steps_with_shards and record.is_file():
            try:
                out[step] = str(json.loads(record.read_text()).get("reason", ""))
            except (OSError, ValueError) as err:
                out[step] = f"(record unreadable: {err})"
    return out


# --------------------------------------------------------------------------------------------- commands
def cmd_ls(args: argparse.Namespace) -> int:
    from rich.table import Table

    from lightning_resilience.checkpoint.delta_tier import DELTA_OF
    from lightning_resilience.checkpoint.format import read_manifest
    from lightning_resilience.report import format_bytes

    where = Path(args.path)
    shards = discover(where)
    if not shards:
        raise CliError(f"no checkpoint shards under {where}")
    out_console = console()
    by_tier: dict[str, list[ShardRef]] = {}
    for s in shards:
        by_tier.setdefault(s.tier, []).append(s)
    for tier, tier_shards in by_tier.items():
        table = Table(title=f"tier {tier}  ({tier_shards[0].root})", title_justify="left")
        for col in ("step", "ranks present", "complete", "bytes", "kind", "created", "verification"):
            table.add_column(col, justify="right" if col in ("step", "bytes") else "left")
        steps: dict[int, list[ShardRef]] = {}
        for s in tier_shards:
            steps.setdefault(s.step, []).append(s)
        for step, reason in _rejected(tier_shards[0].root, set(steps)).items():
            table.add_row(str(step), "0", "no", "-", "-", "-", f"rejected: {reason}")
        for step, group in sorted(steps.items()):
            committed, nbytes, kinds, world, created, verified = 0, 0, set(), set(), 0.0, "-"
            for s in group:
                try:
                    m = read_manifest(s.path)
                except CheckpointCorruptError:
                    continue
                committed += 1
                nbytes += sum(int(f.get("size", 0)) for f in m.files.values())
                kinds.add(f"delta of {m.meta[DELTA_OF]}" if DELTA_OF in m.meta else "full")
                world.add(m.world_size)
                created = max(created, m.created)
                if s.rank == min(x.rank for x in group):
                    verified = _verification(m.meta)
            world_size = max(world) if world else 0
            complete = committed == world_size and len(world) == 1 and len(group) == world_size
            table.add_row(
                str(step),
                f"{len(group)}/{world_size or '?'}",
                "yes" if complete else f"no ({committed} committed)",
                format_bytes(nbytes),
                ", ".join(sorted(kinds)) or "-",
                _when(created),
                verified,
            )
        out_console.print(table)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from lightning_resilience.checkpoint.content import check_content
    from lightning_resilience.checkpoint.delta_tier import DELTA_OF
    from lightning_resilience.checkpoint.format import read_manifest, read_shard, validate_shard

    where = Path(args.path)
    shards = select(discover(where), where, step=args.step, rank=None, tier=getattr(args, "tier", None))
    sizes = {}
    for s in shards:
        try:
            sizes[s.path] = sum(int(f.get("size", 0)) for f in read_manifest(s.path).files.values())
        except CheckpointCorruptError:
            sizes[s.path] = 0
    bad = 0
    worlds: dict[tuple[str, int], tuple[set[int], set[int]]] = {}
    with progress(nbytes=True) as bar:
        task = bar.add_task("verifying", total=sum(sizes.values()) or None)
        for s in shards:
            bar.update(task, description=f"verifying {s.tier} step {s.step} rank {s.rank}")
            try:
                m = validate_shard(s.path)
                if m.rank != s.rank or (
                    s.step >= 0 and parse_step(s.path.parent.name) is not None and m.step != s.step
                ):
                    raise CheckpointCorruptError(
                        f"{s.path}: manifest is for step {m.step} rank {m.rank}, the directory says "
                        f"step {s.step} rank {s.rank}"
                    )
                base = m.meta.get(DELTA_OF)
                if base is not None:
                    base_shard = s.root / step_dirname(int(base)) / s.path.name
                    if not (base_shard / "manifest.json").is_file():
                        raise CheckpointCorruptError(f"{s.path}: delta against full step {base}, which is missing")
                else:  # the tensors are the step's state: its content print (a delta's are checked on restore)
                    _, snap = read_shard(s.path, verify_checksums=False)
                    check_content(snap.tensors, snap.meta, step=m.step, where=str(s.path))
                seen = worlds.setdefault((s.tier, s.step), (set(), set()))
                seen[0].add(m.world_size)
                seen[1].add(m.rank)
                print(
                    f"OK       {s.path}  step={m.step} rank={m.rank}/{m.world_size} files={len(m.files)}"
                    + (f" delta_of={base}" if base is not None else "")
                    + f" verification={_verification(m.meta)}",
                    flush=True,
                )
            except CheckpointCorruptError as err:
                bad += 1
                print(f"CORRUPT  {err}", flush=True)
            bar.advance(task, sizes[s.path])
    roots = {s.tier: s.root for s in shards}
    for tier, root in sorted(roots.items()):
        for step, reason in _rejected(root, {s.step for s in shards if s.tier == tier}).items():
            print(f"REJECTED tier {tier} step {step}: {reason} (never restored)")
    incomplete = 0
    for (tier, step), (world, ranks) in sorted(worlds.items()):
        if len(world) == 1 and len(ranks) < next(iter(world)):
            incomplete += 1
            missing = sorted(set(range(next(iter(world)))) - ranks)
            print(f"WARNING  tier {tier} step {step}: no valid shard here for ranks {missing} (other nodes?)")
    print(
        f"{len(shards) - bad} valid, {bad} corrupt" + (f", {incomplete} steps without every rank" if incomplete else "")
    )
    return 1 if bad else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    if args.step is None and args.rank is None and getattr(args, "listing", False):
        return cmd_ls(args)
    from rich.table import Table

    from lightning_resilience.checkpoint.delta_tier import DELTA_OF
    from lightning_resilience.checkpoint.format import read_manifest
    from lightning_resilience.report import format_bytes

    shard = one_shard(args)
    try:
        m = read_manifest(shard.path)
    except CheckpointCorruptError as err:
        print(f"CORRUPT  {err}")
        return 1
    tensor_bytes = sum(spec.nbytes for spec in m.tensors.values())
    file_bytes = sum(int(f.get("size", 0)) for f in m.files.values())
    out_console = console()
    info = Table(title=f"{shard.path}", show_header=False, title_justify="left")
    info.add_column("field", style="bold")
    info.add_column("value")
    rows = [
        ("tier", shard.tier),
        ("step", str(m.step)),
        ("rank / world size", f"{m.rank} / {m.world_size}"),
        ("rank layout", json.dumps(m.rank_layout, sort_keys=True)),
        ("kind", f"delta of step {m.meta[DELTA_OF]}" if DELTA_OF in m.meta else "full"),
        ("tensors", f"{len(m.tensors)} tensors, {format_bytes(tensor_bytes)}"),
        ("files", f"{len(m.files)} files, {format_bytes(file_bytes)} on disk"),
        ("created", _when(m.created)),
        ("format", m.format),
        ("versions", ", ".join(f"{k} {v}" for k, v in sorted(m.versions.items()))),
        ("meta", json.dumps(m.meta, sort_keys=True)),
    ]
    for k, v in rows:
        info.add_row(k, v)
    out_console.print(info)
    biggest = sorted(m.tensors.items(), key=lambda kv: kv[1].nbytes, reverse=True)
    limit = len(biggest) if args.all_tensors else min(len(biggest), 15)
    table = Table(title=f"tensors ({limit} of {len(biggest)}, largest first)", title_justify="left")
    for col in ("name", "shape", "dtype", "bytes"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for name, spec in biggest[:limit]:
        table.add_row(name, str(list(spec.shape)), str(spec.dtype).removeprefix("torch."), format_bytes(spec.nbytes))
    out_console.print(table)
    return 0


def _read_state(shard: ShardRef) -> tuple[dict[str, Any], int]:
    """The Lightning checkpoint dict of one shard, validated and (for a delta) rebuilt from its base, and the world
    size of the job that wrote it."""
    from lightning_resilience.checkpoint.delta_tier import DeltaLocalTier
    from lightning_resilience.checkpoint.format import read_manifest, read_shard
    from lightning_resilience.checkpoint.tier import TierIdentity
    from lightning_resilience.checkpoint.tree import unflatten_state

    manifest = read_manifest(shard.path)
    if parse_step(shard.path.parent.name) is not None:
        tier = DeltaLocalTier(shard.root, every_n_steps=1, keep=1, name=shard.tier)
        tier.bind_for_reading(TierIdentity(manifest.rank, manifest.world_size))
        snap = tier.read(shard.step)
    else:
        _, snap = read_shard(shard.path)
    try:
        state = unflatten_state(snap.skeleton, snap.tensors)
    except ValueError as err:
        raise CliError(
            f"{shard.path}: {err}; a sharded (FSDP, tensor-parallel) checkpoint cannot be exported from one rank's "
            "shard"
        ) from err
    if not isinstance(state, dict) or "state_dict" not in state:
        raise CliError(f"{shard.path}: not a Lightning checkpoint (no 'state_dict' in it)")
    return state, manifest.world_size


def cmd_export(args: argparse.Namespace) -> int:
    out = Path(args.to)
    suffix = out.suffix.lower()
    if suffix not in (*_TORCH_SUFFIXES, ".safetensors"):
        raise CliError(f"--to must end in .ckpt, .pt, .pth or .safetensors, got {out.name!r}")
    if out.is_dir():
        raise CliError(f"--to {out} is a directory; give a file name")
    if suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError as err:
            raise CliError("exporting to .safetensors needs the safetensors package: pip install safetensors") from err
    import torch

    shard = one_shard(args)
    with progress(nbytes=False) as bar:
        task = bar.add_task(f"reading step {shard.step} rank {shard.rank}", total=3)
        try:
            state, world_size = _read_state(shard)
        except CheckpointCorruptError as err:
            print(f"CORRUPT  {err}")
            return 1
        bar.advance(task)
        bar.update(task, description=f"writing {out}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            if suffix == ".safetensors":
                tensors = {
                    k: v.detach().cpu().contiguous().clone()
                    for k, v in state["state_dict"].items()
                    if isinstance(v, torch.Tensor)
                }
                save_file(
                    tensors, str(tmp), metadata={"step": str(shard.step), "global_step": str(_global_step(state))}
                )
            else:
                torch.save(state, tmp)
            bar.advance(task)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
        bar.advance(task)
    what = "model weights" if suffix == ".safetensors" else "Lightning checkpoint"
    note = ""
    if world_size > 1:
        note = (
            f" (rank {shard.rank} of a {world_size}-rank job: under DDP its model and optimizer state are the whole "
            "state; other ranks' RNG streams and data positions are not in it)"
        )
    print(
        f"exported step {shard.step} (tier {shard.tier}, rank {shard.rank}, global step {_global_step(state)}) as "
        f"{what} to {out}{note}"
    )
    return 0


def _global_step(state: dict[str, Any]) -> Any:
    return state.get("global_step", "?")


def _add_verify(sub: Any, name: str, help: str) -> None:
    p = sub.add_parser(name, help=help)
    p.add_argument("path", help="a checkpoint root, a directory of tiers, a step or a shard directory")
    p.add_argument("--step", type=non_negative, default=None, help="only this step")
    p.add_argument("--tier", default=None, help="only this tier (its directory under path)")
    p.set_defaults(fn=cmd_verify)


def _add_inspect(sub: Any, name: str, help: str, *, listing: bool) -> None:
    p = sub.add_parser(name, help=help)
    p.add_argument("path")
    p.add_argument("--step", type=non_negative, default=None, help="step to show (default: the newest)")
    p.add_argument(
        "--rank", type=non_negative, default=None, help="rank whose manifest to show (default: the lowest present)"
    )
    p.add_argument("--tier", default=None, help="tier to read from when several hold the step")
    p.add_argument("--all-tensors", action="store_true", help="list every tensor, not only the largest")
    p.set_defaults(fn=cmd_inspect, listing=listing)


def add_parsers(sub: Any) -> None:
    """``ckpt {ls,verify,inspect,export}`` and the top-level ``verify`` and ``inspect`` shortcuts."""
    ckpt = sub.add_parser("ckpt", help="list, verify, inspect and export checkpoints")
    csub = ckpt.add_subparsers(dest="ckpt_command", required=True)
    ls = csub.add_parser("ls", help="list tiers, steps and ranks under a checkpoint root")
    ls.add_argument("path")
    ls.set_defaults(fn=cmd_ls)
    _add_verify(csub, "verify", "check sizes and xxh3 checksums of every shard; exit 1 if any is bad")
    _add_inspect(csub, "inspect", "show one shard's manifest: tensors, meta, versions, layout", listing=False)
    export = csub.add_parser("export", help="export a step as a plain Lightning .ckpt or model .safetensors")
    export.add_argument("path")
    export.add_argument("--step", type=non_negative, default=None, help="step to export (default: the newest)")
    export.add_argument(
        "--rank", type=non_negative, default=None, help="rank whose shard to export (default: the lowest present)"
    )
    export.add_argument("--tier", default=None, help="tier to read from when several hold the step")
    export.add_argument("--to", required=True, help="output file: *.ckpt (or .pt, .pth) or *.safetensors")
    export.set_defaults(fn=cmd_export)

    _add_verify(sub, "verify", "same as `ckpt verify`")
    _add_inspect(sub, "inspect", "`ckpt ls` for a path; `ckpt inspect` with --step or --rank", listing=True)
