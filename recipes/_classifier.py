"""A sequence classifier on a TinyGPT backbone, optionally initialised from a pre-trained GPT checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from ._gpt import TinyGPT

__all__ = ["GPTClassifier"]


class GPTClassifier(LightningModule):
    """Mean-pooled TinyGPT features and a linear head; batches are ``(tokens [B, T], labels [B])``.

    Args:
        num_classes: output classes.
        backbone: TinyGPT keywords (``recipes._gpt.gpt_preset``).
        init_from: a ``.ckpt`` exported from a pre-training run (``lightning-resilience ckpt export ... --to x.ckpt``)
            whose ``state_dict`` initialises the backbone; None starts from random weights.
        lr: AdamW learning rate (head and backbone alike).
    """

    def __init__(
        self, num_classes: int, backbone: dict[str, Any], init_from: str | None = None, lr: float = 1e-3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = TinyGPT(**backbone)
        self.head = nn.Linear(int(backbone.get("d_model", 128)), num_classes)
        if init_from:
            self._load_backbone(Path(init_from))

    def _load_backbone(self, path: Path) -> None:
        if not path.is_file():
            raise ValueError(f"model.init_from: no checkpoint file at {path} (export one with `ckpt export`)")
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        state = ckpt.get("state_dict", ckpt)
        missing, unexpected = self.backbone.load_state_dict(state, strict=False)
        if unexpected or len(missing) == len(self.backbone.state_dict()):
            raise ValueError(
                f"model.init_from: {path} does not hold TinyGPT weights (unexpected keys {unexpected[:5]})"
            )

    def features(self, idx: Tensor) -> Tensor:
        gpt = self.backbone
        x = gpt.drop(gpt.tok_emb(idx) + gpt.pos_emb(torch.arange(idx.shape[1], device=idx.device)))
        for block in gpt.blocks:
            x = block(x)
        pooled: Tensor = gpt.ln_f(x).mean(dim=1)
        return pooled

    def forward(self, idx: Tensor) -> Tensor:
        logits: Tensor = self.head(self.features(idx))
        return logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, labels = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits, labels)
        self.log("train_loss", loss)
        self.log("train_acc", (logits.argmax(-1) == labels).float().mean())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.01)
