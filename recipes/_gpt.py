"""A small GPT-style decoder-only language model used as a realistic training workload.

The model is intentionally self-contained (plain torch ops, no external model zoo) so that resilience tests can
train it on CPU in seconds while still exercising the pieces that matter for exact resume: dropout RNG, AdamW state,
and a step-based LR schedule.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn

__all__ = ["TinyGPT", "WarmupCosineLambda", "count_parameters", "gpt_preset"]

# Exact parameter counts (weight-tied head, biases on all Linear layers); each block holds 12*d^2 + 13*d parameters.
#   tiny : vocab 256,  seq 64,  d 128, 2 layers -> 437,760 parameters (~0.44M)
#   small: vocab 8192, seq 128, d 512, 6 layers -> 23,175,168 parameters (~23.2M)
#   gpt2 : vocab 50304, seq 1024, d 768, 12 layers -> 124,475,904 parameters (~124M, GPT-2 small)
_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 256,
        "seq_len": 64,
        "d_model": 128,
        "n_layer": 2,
        "n_head": 4,
        "dropout": 0.1,
        "lr": 3e-4,
        "weight_decay": 0.1,
        "warmup_steps": 10,
        "max_steps": 1000,
    },
    "small": {
        "vocab_size": 8192,
        "seq_len": 128,
        "d_model": 512,
        "n_layer": 6,
        "n_head": 8,
        "dropout": 0.1,
        "lr": 3e-4,
        "weight_decay": 0.1,
        "warmup_steps": 100,
        "max_steps": 10000,
    },
    # GPT-2 small's shape; its tokenizer's 50257 ids padded to a multiple of 64, as nanoGPT does
    "gpt2": {
        "vocab_size": 50304,
        "seq_len": 1024,
        "d_model": 768,
        "n_layer": 12,
        "n_head": 12,
        "dropout": 0.0,
        "lr": 6e-4,
        "weight_decay": 0.1,
        "warmup_steps": 2000,
        "max_steps": 600000,
    },
}


def gpt_preset(name: str) -> dict[str, Any]:
    """Return the constructor kwargs for a named :class:`TinyGPT` size preset.

    Args:
        name: Preset name: ``"tiny"`` (~0.44M parameters), ``"small"`` (~23.2M) or ``"gpt2"`` (GPT-2 small,
            ~124M; for a nanoGPT token file of GPT-2 ids).

    Returns:
        A fresh dict of keyword arguments for :class:`TinyGPT` (safe to mutate).

    Raises:
        ValueError: If ``name`` is not a known preset.
    """
    if name not in _PRESETS:
        raise ValueError(f"Unknown GPT preset {name!r}; expected one of {sorted(_PRESETS)}")
    return dict(_PRESETS[name])


def count_parameters(model: nn.Module) -> int:
    """Count the unique parameters of a module.

    Args:
        model: Any ``torch.nn.Module``.

    Returns:
        Number of scalar parameters; tied weights are counted once because ``parameters()`` de-duplicates them.
    """
    return sum(p.numel() for p in model.parameters())


class WarmupCosineLambda:
    """LR multiplier: linear warmup, then cosine decay to ``min_ratio`` of the base LR.

    Implemented as a class rather than a closure so that ``LambdaLR`` (and anything that deep-copies or pickles the
    scheduler, e.g. checkpointing or multiprocessing) can serialise it.

    Args:
        warmup_steps: Number of steps over which the multiplier ramps linearly from ~0 to 1.
        max_steps: Step at which the cosine reaches ``min_ratio``; the multiplier stays there afterwards.
        min_ratio: Final multiplier relative to the base LR.
    """

    def __init__(self, warmup_steps: int, max_steps: int, min_ratio: float = 0.1) -> None:
        self.warmup_steps = max(0, int(warmup_steps))
        self.max_steps = max(1, int(max_steps))
        self.min_ratio = float(min_ratio)

    def __call__(self, step: int) -> float:
        """Return the LR multiplier for optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            # +1 so the very first step already moves the weights instead of using LR 0.
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.max_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * cosine


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on top of ``scaled_dot_product_attention``.

    Args:
        d_model: Embedding width.
        n_head: Number of attention heads; must divide ``d_model``.
        dropout: Dropout probability for attention weights and the output projection.
    """

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_head != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Apply attention to ``x`` of shape ``[B, T, C]`` and return the same shape."""
        bsz, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # [B, T, C] -> [B, H, T, C/H] as expected by SDPA.
        q = q.view(bsz, seq, self.n_head, width // self.n_head).transpose(1, 2)
        k = k.view(bsz, seq, self.n_head, width // self.n_head).transpose(1, 2)
        v = v.view(bsz, seq, self.n_head, width // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(bsz, seq, width)
        out: Tensor = self.resid_dropout(self.proj(y))
        return out


class MLP(nn.Module):
    """Position-wise feed-forward network with a 4x hidden expansion and GELU.

    Args:
        d_model: Embedding width.
        dropout: Dropout probability applied to the output.
    """

    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to ``x`` of shape ``[B, T, C]``."""
        out: Tensor = self.dropout(self.proj(F.gelu(self.fc(x))))
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block (LN -> attention -> residual, LN -> MLP -> residual).

    Args:
        d_model: Embedding width.
        n_head: Number of attention heads.
        dropout: Dropout probability.
    """

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block to ``x`` of shape ``[B, T, C]``."""
        x = x + self.attn(self.ln1(x))
        out: Tensor = x + self.mlp(self.ln2(x))
        return out


class TinyGPT(LightningModule):
    """Decoder-only GPT language model packaged as a LightningModule.

    Batches are LongTensors of shape ``[B, seq_len + 1]``; the first ``seq_len`` tokens are the inputs and the last
    ``seq_len`` tokens are the next-token targets.

    Args:
        vocab_size: Number of distinct tokens.
        seq_len: Maximum context length (size of the learned positional embedding).
        d_model: Embedding width.
        n_layer: Number of transformer blocks.
        n_head: Number of attention heads per block.
        dropout: Dropout probability used throughout (embeddings, attention, residuals).
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay, applied only to parameters with two or more dimensions.
        warmup_steps: Linear warmup length in optimizer steps.
        max_steps: Step at which cosine decay reaches 10% of ``lr``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 64,
        d_model: int = 128,
        n_layer: int = 2,
        n_head: int = 4,
        dropout: float = 0.1,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
        max_steps: int = 1000,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(d_model, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        # Tie after init so both names refer to one tensor (initialised once, counted once, saved once).
        self.lm_head.weight = self.tok_emb.weight
        # Scaled init of residual projections (GPT-2) keeps the residual stream variance stable with depth.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        """Compute next-token logits.

        Args:
            idx: LongTensor of token ids, shape ``[B, T]`` with ``T <= seq_len``.

        Returns:
            Logits of shape ``[B, T, vocab_size]``.
        """
        seq = idx.shape[1]
        if seq > self.hparams["seq_len"]:
            raise ValueError(f"Sequence length {seq} exceeds model context {self.hparams['seq_len']}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.lm_head(self.ln_f(x))
        return logits

    def compute_loss(self, batch: Tensor) -> Tensor:
        """Return the mean next-token cross-entropy for a ``[B, seq_len + 1]`` batch."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        """Compute and log the training loss for one batch."""
        loss = self.compute_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        """Compute and log the validation loss for one batch."""
        loss = self.compute_loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        """Build AdamW with decoupled decay on matrices only, plus a per-step warmup/cosine schedule."""
        # Biases and LayerNorm gains are 1-D; decaying them hurts more than it regularises.
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams["weight_decay"]},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams["lr"],
            betas=(0.9, 0.95),
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, WarmupCosineLambda(self.hparams["warmup_steps"], self.hparams["max_steps"], min_ratio=0.1)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }
