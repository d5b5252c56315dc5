"""`lightning-resilience` command line: run a recipe, list and verify checkpoints."""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.format import MANIFEST, validate_shard

RECIPES = ("pretrain_gpt",)


def _shards(root: Path) -> list[Path]:
    """Every shard directory under ``root`` (a tier root, a step directory or a shard itself)."""
    if (root / MANIFEST).exists() or root.name.startswith("rank_"):
        return [root]
    return sorted(p for p in root.rglob("rank_*") if p.is_dir())


def cmd_verify(args: argparse.Namespace) -> int:
    bad = 0
    shards = _shards(Path(args.path))
    if not shards:
        print(f"no checkpoint shards under {args.path}", file=sys.stderr)
        return 2
    for shard in shards:
        try:
            m = validate_shard(shard)
            print(f"OK       {shard}  step={m.step} rank={m.rank}/{m.world_size} files={len(m.files)}")
        except CheckpointCorruptError as err:
            bad += 1
            print(f"CORRUPT  {err}")
    print(f"{len(shards) - bad} valid, {bad} corrupt")
    return 1 if bad else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    for shard in _shards(Path(args.path)):
        manifest = json.loads((shard / MANIFEST).read_text()) if (shard / MANIFEST).exists() else None
        if manifest is None:
            print(f"{shard}: no manifest (uncommitted)")
            continue
        nbytes = sum(f["size"] for f in manifest["files"].values())
        print(
            f"{shard}: step {manifest['step']} rank {manifest['rank']}/{manifest['world_size']} "
            f"{len(manifest['tensors'])} tensors {nbytes / 2**20:.2f} MiB versions {manifest['versions']}"
        )
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    if args.recipe not in RECIPES:
        print(f"unknown recipe {args.recipe!r}; choose one of {', '.join(RECIPES)}", file=sys.stderr)
        return 2
    sys.argv = [f"recipes.{args.recipe}", *args.overrides]
    runpy.run_module(f"recipes.{args.recipe}", run_name="__main__", alter_sys=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["simulate"]:  # its own parser: every flag after the word belongs to the simulator
        from lightning_resilience.sim.cli import simulate_main

        return int(simulate_main(argv[1:]))
    parser = argparse.ArgumentParser(prog="lightning-resilience", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("simulate", help="predict ETTR and the best checkpoint interval at scale (see simulate --help)")
    run = sub.add_parser("run", help="run a recipe with Hydra overrides")
    run.add_argument("recipe")
    run.add_argument("overrides", nargs=argparse.REMAINDER)
    run.set_defaults(fn=cmd_run)
    verify = sub.add_parser("verify", help="validate sizes and checksums of every shard under a path")
    verify.add_argument("path")
    verify.set_defaults(fn=cmd_verify)
    inspect = sub.add_parser("inspect", help="list the checkpoints under a path")
    inspect.add_argument("path")
    inspect.set_defaults(fn=cmd_inspect)
    args = parser.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
