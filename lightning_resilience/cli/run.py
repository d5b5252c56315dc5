"""``lightning-resilience run``: run a recipe with Hydra overrides (the installed ``lightning_resilience.recipes``,
from any directory)."""

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
    module = f"lightning_resilience.recipes.{args.recipe}"
    sys.argv = [module, *args.overrides]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def add_parsers(sub: Any) -> None:
    run = sub.add_parser("run", help="run a recipe with Hydra overrides")
    run.add_argument("recipe")
    run.add_argument("overrides", nargs=argparse.REMAINDER)
    run.set_defaults(fn=cmd_run)
