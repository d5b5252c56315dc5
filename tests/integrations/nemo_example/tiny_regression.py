"""A NeMo example script, shaped like the ones NeMo ships (``hydra_runner``, ``exp_manager``, a ``ModelPT``), with
nothing of lightning_resilience in it: the tests switch the suite on with command-line overrides only.

    python tiny_regression.py +resilience=default resilience.run_dir=/shared/run-17
"""

from typing import Any

import lightning.pytorch as pl
import torch
from nemo.core import ModelPT
from nemo.core.config import hydra_runner
from nemo.utils.exp_manager import exp_manager
from omegaconf import DictConfig
from torch.utils.data import DataLoader, TensorDataset


class TinyRegressor(ModelPT):
    """An MLP with dropout on a shuffled synthetic regression set; NeMo builds its optimizer from ``cfg.optim``."""

    def __init__(self, cfg: DictConfig, trainer: pl.Trainer | None = None) -> None:
        super().__init__(cfg=cfg, trainer=trainer)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
        )

    def setup_training_data(self, train_data_config: DictConfig) -> None:
        g = torch.Generator().manual_seed(int(train_data_config.seed))
        x = torch.randn(int(train_data_config.num_samples), 8, generator=g)
        y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(x.shape[0], 1, generator=g)
        self._train_dl = DataLoader(TensorDataset(x, y), batch_size=int(train_data_config.batch_size), shuffle=True)

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


@hydra_runner(config_path="conf", config_name="tiny_regression")
def main(cfg: DictConfig) -> None:
    pl.seed_everything(cfg.seed)
    trainer = pl.Trainer(**cfg.trainer)
    exp_manager(trainer, cfg.get("exp_manager", None))
    model = TinyRegressor(cfg=cfg.model, trainer=trainer)
    trainer.fit(model)


if __name__ == "__main__":
    main()
