"""Deterministic synthetic token data for recipe training runs (no downloads, no files on disk).

Every sample is a pure function of ``(seed, index)``, which lets resilience tests compare an interrupted-and-resumed
run against an uninterrupted one bit for bit, regardless of worker count or sampling order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "SyntheticClassification",
    "SyntheticClassificationDataModule",
    "SyntheticTokenDataModule",
    "SyntheticTokens",
]

# Multipliers are odd so the affine map is a bijection mod any power-of-two vocab (no collapse onto short cycles
# through a single token); the small fixed set keeps the task learnable by a tiny model.
_MULTIPLIERS: tuple[int, ...] = (1, 3, 5, 7)
_INCREMENTS: tuple[int, ...] = (1, 2, 3, 5, 7, 11, 13, 17)
_NOISE_PROB = 0.1
# Large odd stride so neighbouring seeds never share per-item generator seeds for realistic dataset sizes.
_SEED_STRIDE = 1_000_003


class SyntheticTokens(Dataset[Tensor]):
    """Map-style dataset of learnable token sequences.

    Item ``i`` follows the recurrence ``x[t+1] = (a * x[t] + b) % vocab_size`` with ``(a, b)`` drawn per item from a
    small fixed set and a random start token; 10% of positions are then replaced by uniform random tokens so the task
    is not trivially memorisable. A model can infer ``(a, b)`` from context and predict the rest.

    Args:
        num_samples: Number of items in the dataset.
        seq_len: Model context length; each item has ``seq_len + 1`` tokens (inputs plus shifted targets).
        vocab_size: Number of distinct tokens.
        seed: Base seed; item ``i`` uses a ``torch.Generator`` seeded with ``seed * 1_000_003 + index_offset + i``.
        index_offset: Added to every index before seeding, so disjoint splits can be drawn from the same seed.
    """

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0, index_offset: int = 0) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.index_offset = index_offset

    def __len__(self) -> int:
        """Return the number of items."""
        return self.num_samples

    def __getitem__(self, index: int) -> Tensor:
        """Return item ``index`` as a LongTensor of shape ``[seq_len + 1]``."""
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for dataset of size {self.num_samples}")
        gen = torch.Generator()
        gen.manual_seed(self.seed * _SEED_STRIDE + self.index_offset + index)
        length = self.seq_len + 1
        a = _MULTIPLIERS[int(torch.randint(len(_MULTIPLIERS), (1,), generator=gen))]
        b = _INCREMENTS[int(torch.randint(len(_INCREMENTS), (1,), generator=gen))]
        x = int(torch.randint(self.vocab_size, (1,), generator=gen))
        tokens = [x]
        for _ in range(length - 1):
            x = (a * x + b) % self.vocab_size
            tokens.append(x)
        seq = torch.tensor(tokens, dtype=torch.long)
        # Observation noise only: the clean recurrence continues underneath, so one corrupted token does not derail
        # the rest of the sequence.
        noise_mask = torch.rand(length, generator=gen) < _NOISE_PROB
        noise = torch.randint(self.vocab_size, (length,), generator=gen)
        return torch.where(noise_mask, noise, seq)


class SyntheticTokenDataModule(LightningDataModule):
    """LightningDataModule serving :class:`SyntheticTokens` train and validation splits.

    Args:
        batch_size: Samples per batch.
        num_samples: Training set size; the validation set has ``num_samples // 16`` items (at least one).
        seq_len: Model context length.
        vocab_size: Number of distinct tokens.
        seed: Base seed for both splits (validation items use indices after the training items, so they never
            overlap).
        num_workers: DataLoader worker processes.
        shuffle: Whether the training loader shuffles.
        loader_cls: Factory with the ``torch.utils.data.DataLoader`` signature used for the training loader, e.g.
            a resumable DataLoader subclass. Called as
            ``loader_cls(dataset, batch_size=..., shuffle=..., num_workers=..., drop_last=True)``.
    """

    def __init__(
        self,
        batch_size: int = 8,
        num_samples: int = 2048,
        seq_len: int = 64,
        vocab_size: int = 256,
        seed: int = 1234,
        num_workers: int = 0,
        shuffle: bool = True,
        loader_cls: Callable[..., DataLoader[Any]] = DataLoader,
    ) -> None:
        super().__init__()
        # The loader factory is code, not configuration: keep it out of hparams.yaml / checkpoint hyper-parameters.
        self.save_hyperparameters(ignore=["loader_cls"])
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.loader_cls = loader_cls
        # Datasets are lazy (items generated on access), so building them eagerly is free and lets the loaders be
        # requested without ``setup()`` having run first.
        self.train_dataset = SyntheticTokens(num_samples, seq_len, vocab_size, seed=seed)
        self.val_dataset = SyntheticTokens(
            max(1, num_samples // 16), seq_len, vocab_size, seed=seed, index_offset=num_samples
        )

    def train_dataloader(self) -> DataLoader[Any]:
        """Build the training loader through ``loader_cls``."""
        return self.loader_cls(
            self.train_dataset,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            num_workers=self.num_workers,
            drop_last=True,
        )

    def val_dataloader(self) -> DataLoader[Any]:
        """Build the fixed, unshuffled validation loader."""
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
        )


class SyntheticClassification(Dataset[tuple[Tensor, Tensor]]):
    """Token sequences whose class decides which band of the vocabulary half of their tokens come from.

    Item ``i`` is a pure function of ``(seed, i)``: label ``y`` is drawn uniformly; each token is drawn from class
    ``y``'s band of ``vocab_size // num_classes`` ids with probability 1/2, else uniformly. Learnable in a few
    dozen steps by a tiny model, never trivially (every band also appears in every other class's noise).
    """

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, num_classes: int, seed: int = 0) -> None:
        if num_classes < 2 or vocab_size < num_classes:
            raise ValueError(f"data.num_classes must be in [2, vocab_size], got {num_classes}")
        self.num_samples, self.seq_len, self.vocab_size = num_samples, seq_len, vocab_size
        self.num_classes, self.seed = num_classes, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        gen = torch.Generator().manual_seed(self.seed * _SEED_STRIDE + index)
        label = int(torch.randint(self.num_classes, (1,), generator=gen))
        band = self.vocab_size // self.num_classes
        in_band = torch.randint(band, (self.seq_len,), generator=gen) + label * band
        uniform = torch.randint(self.vocab_size, (self.seq_len,), generator=gen)
        pick = torch.rand(self.seq_len, generator=gen) < 0.5
        return torch.where(pick, in_band, uniform), torch.tensor(label)


class SyntheticClassificationDataModule(LightningDataModule):
    """Train loader over :class:`SyntheticClassification` (``loader_cls`` as in :class:`SyntheticTokenDataModule`)."""

    def __init__(
        self,
        batch_size: int = 16,
        num_samples: int = 1024,
        seq_len: int = 32,
        vocab_size: int = 256,
        num_classes: int = 4,
        seed: int = 1234,
        num_workers: int = 0,
        loader_cls: Callable[..., DataLoader[Any]] = DataLoader,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["loader_cls"])
        self.batch_size, self.num_workers, self.loader_cls = batch_size, num_workers, loader_cls
        self.train_dataset = SyntheticClassification(num_samples, seq_len, vocab_size, num_classes, seed=seed)

    def train_dataloader(self) -> DataLoader[Any]:
        return self.loader_cls(
            self.train_dataset, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers, drop_last=True
        )
