"""A plain Lightning script with no import of lightning_resilience: the suite comes from ``LIGHTNING_RESILIENCE``
alone (Lightning's ``callbacks_factory`` entry point), as a user switches it on for a script they do not change.

The user's code is ``_user_script.py``'s (``DataLoader(shuffle=True)`` with workers, dropout, ``torch.randn`` noise,
StepLR, DDP on 2 CPU ranks); the drill plumbing comes from ``_user_code.py``, which imports nothing of ours either.
A resumed attempt reports the step it started from as its restored step. Checkpointing is left on, as a user leaves
it: the suite replaces Lightning's default ``ModelCheckpoint`` with its own checkpoint callback.
"""

from __future__ import annotations

import os
import sys

import torch
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import DataLoader

from tests.drills._user_code import AugmentedPoints, Regressor, drill_callbacks, parse, save_weights


def main(argv: list[str]) -> None:
    args = parse(argv, __doc__.splitlines()[0])
    seed_everything(args.seed)
    loader = DataLoader(AugmentedPoints(), batch_size=8, shuffle=True, num_workers=args.workers)
    model = Regressor()
    trainer = Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp",
        callbacks=drill_callbacks(args),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(args.run_dir),
    )
    trainer.fit(model, loader)  # a decided stop ends the process here, with the suite's code
    save_weights(trainer, model, args)


if __name__ == "__main__":
    main(sys.argv[1:])
    if torch.distributed.is_initialized():
        # an explicit teardown: left to interpreter exit, gloo's threads can abort the process (SIGABRT)
        torch.distributed.destroy_process_group()
