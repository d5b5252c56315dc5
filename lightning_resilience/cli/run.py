"""``lightning-resilience run``: run a recipe with Hydra overrides."""

from __future__ import annotations

import argparse
import runpy
import sys
from typing import Any

__all__ = ["RECIPES", "add_parsers", "cmd_run"]

RECIPES = ("pretrain_gpt", "finetune_classifier")


def cmd_run(args: argparse.Namespace) -> int:
    if args.recipe not in RECIPES:
        print(f"unknown recipe {args.recipe!r}; choose one of {', '.join(RECIPES)}", file=sys.stderr)
        return 2
    sys.argv = [f"recipes.{args.recipe}", *args.overrides]
    runpy.run_module(f"recipes.{args.recipe}", run_name="__main__", alter_sys=True)
    return 0


def add_parsers(sub: Any) -> None:
    run = sub.add_parser("run", help="run a recipe with Hydra overrides")
    run.add_argument("recipe")
    run.add_argument("overrides", nargs=argparse.REMAINDER)
    run.set_defaults(fn=cmd_run)
