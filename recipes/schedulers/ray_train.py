"""lightning-resilience under Ray Train: ``FailureConfig`` retries the worker group, the suite's verdicts say when not.

Ray Train restarts the whole worker group after a worker raises, up to ``FailureConfig(max_failures=N)`` times, from
the newest checkpoint (ours: ``TieredCheckpoint`` resumes by itself); it reads no exit code. So the training
function turns the suite's decided exit (:class:`~lightning_resilience.exit_codes.DecidedExit`) into Ray's terms
(:func:`ray_outcome`): a code a scheduler may retry (86 hang, 87 preempted, 83/84 on other
hardware) is raised, so Ray retries it; a code that must not be retried (88 no progress, 89 diverged) is returned
as the result, so the run ends, and the driver exits with it::

    python -m lightning_resilience.recipes.schedulers.ray_train --workers 2 --max-failures 3

Progress between retries: Ray's own attempts count failures, not progress; a job that fails at the same step keeps
failing until ``max_failures`` - keep it small, or run ``lightning-resilience launch`` inside one Ray task instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from lightning_resilience.exit_codes import DecidedExit, ExitCode
from lightning_resilience.launch.policy import requeue_wanted

__all__ = ["RetryableExit", "failure_config", "main", "ray_outcome", "train_loop"]


class RetryableExit(RuntimeError):
    """Raised in a Ray Train worker for a decided exit that Ray should retry (it restarts the worker group)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"exit code {code}: {reason}")
        self.code = code


def ray_outcome(code: int) -> str:
    """``"done"`` (0), ``"retry"`` (raise: Ray restarts the group) or ``"stop"`` (return: the run ends, no retry)."""
    if code == int(ExitCode.OK):
        return "done"
    return "retry" if requeue_wanted(code) else "stop"


def train_loop(fit: Callable[[], None]) -> dict[str, Any]:
    """Run ``fit`` (the user's ``trainer.fit`` with the suite's callbacks) in a Ray Train worker, in Ray's terms.

    Raises:
        RetryableExit: the suite ended the fit with a code Ray should retry.
    """
    try:
        fit()
    except DecidedExit as decided:
        code = int(decided.exit_code)
        if ray_outcome(code) == "retry":
            raise RetryableExit(code, decided.reason) from decided
        return {"exit_code": code, "reason": decided.reason}
    return {"exit_code": 0, "reason": "finished"}


def failure_config(max_failures: int) -> Any:
    """Ray Train's ``FailureConfig``: retries of the worker group (each resumes from the newest checkpoint)."""
    from ray.train import FailureConfig

    return FailureConfig(max_failures=max_failures)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - needs a Ray cluster
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-failures", type=int, default=3)
    parser.add_argument("--run-dir", default="runs/ray")
    args = parser.parse_args(argv)
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def worker(config: dict[str, Any]) -> None:
        import ray.train
        import torch
        from lightning.pytorch import LightningModule, Trainer
        from torch.utils.data import DataLoader, TensorDataset

        from lightning_resilience import LocalTier, MemoryTier, TieredCheckpoint

        class Regression(LightningModule):  # the user's model goes here
            def __init__(self) -> None:
                super().__init__()
                self.net = torch.nn.Linear(16, 1)

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                x, y = batch
                return torch.nn.functional.mse_loss(self.net(x), y)

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.01)

        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 16, generator=g)
        data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16, shuffle=True)
        tiers = [MemoryTier(every_n_steps=1, keep=2), LocalTier(f"{config['run_dir']}/ckpt", every_n_steps=20)]
        trainer = Trainer(max_steps=200, accelerator="cpu", strategy="ddp", callbacks=[TieredCheckpoint(tiers=tiers)],
                          logger=False, enable_progress_bar=False)  # fmt: skip
        ray.train.report(train_loop(lambda: trainer.fit(Regression(), data)))

    trainer = TorchTrainer(
        worker,
        train_loop_config={"run_dir": args.run_dir},
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(failure_config=failure_config(args.max_failures)),
    )
    result = trainer.fit()
    code = int((result.metrics or {}).get("exit_code", 1))
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
