"""Real text for ``pretrain_gpt``: a token file (nanoGPT-style flat ``uint16`` memmap, e.g. ``train.bin`` from its
``prepare.py``) or a text file read byte by byte (vocabulary 256, no tokenizer to install).

Either is cut into consecutive windows of ``seq_len + 1`` tokens (inputs plus shifted targets, the windows overlap by
one token); item ``i`` is window ``i``, so the dataset is map-style and a plain ``DataLoader(shuffle=True)``
resumes exactly. The file is memory-mapped, never read whole.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

__all__ = ["CORPUS_KINDS", "CorpusDataModule", "TokenWindows", "open_corpus"]

CORPUS_KINDS = ("tokens", "text")
_SCAN_CHUNK = 1 << 24  # tokens per chunk when checking the largest id


def open_corpus(path: str | Path, kind: Literal["tokens", "text"]) -> np.ndarray:
    """The file's tokens, memory-mapped: ``uint16`` for a token file, one ``uint8`` per byte for a text file.

    Raises:
        ValueError: no such file, an empty one, or a token file whose size is not a whole number of ``uint16``.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"data.path: no such file {str(file)!r}")
    size = file.stat().st_size
    if kind == "tokens" and size % 2:
        raise ValueError(f"data.path: {file} has {size} bytes, not a flat uint16 token file (nanoGPT .bin)")
    tokens = np.memmap(file, dtype=np.uint16 if kind == "tokens" else np.uint8, mode="r")
    if len(tokens) < 2:
        raise ValueError(f"data.path: {file} holds fewer than two tokens")
    return tokens


def largest_token(tokens: np.ndarray) -> int:
    """The largest id in ``tokens`` (read in chunks: a memmap of any size)."""
    return max(int(tokens[i : i + _SCAN_CHUNK].max()) for i in range(0, len(tokens), _SCAN_CHUNK))


class TokenWindows(Dataset[Tensor]):
    """Consecutive windows of ``seq_len + 1`` tokens of a token array; ``num_samples`` limits them (None: all)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, num_samples: int | None = None) -> None:
        if seq_len < 1:
            raise ValueError(f"data.seq_len must be >= 1, got {seq_len}")
        windows = (len(tokens) - 1) // seq_len
        if windows < 1:
            raise ValueError(f"data.path holds {len(tokens)} tokens: not one window of data.seq_len={seq_len} + 1")
        if num_samples is not None and not num_samples >= 1:
            raise ValueError(f"data.num_samples must be >= 1 or null, got {num_samples}")
        self.tokens, self.seq_len = tokens, seq_len
        self.windows = windows if num_samples is None else min(windows, num_samples)

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index: int) -> Tensor:
        if not 0 <= index < self.windows:
            raise IndexError(f"window {index} out of range for {self.windows} windows")
        start = index * self.seq_len
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        return torch.from_numpy(window)


class CorpusDataModule(LightningDataModule):
    """Train loader over the windows of a token or text file.

    Args:
        path: the file.
        kind: ``tokens`` (flat ``uint16``, nanoGPT) or ``text`` (bytes).
        vocab_size: the model's vocabulary: every id in the file must be below it (checked here, before training).
        batch_size, seq_len, num_workers: of the loader and its windows.
        num_samples: windows per epoch (None: all of them).
        loader_cls: the train loader's factory (``DataLoader`` signature).
    """

    def __init__(
        self,
        path: str,
        kind: Literal["tokens", "text"],
        vocab_size: int,
        batch_size: int = 8,
        seq_len: int = 64,
        num_samples: int | None = None,
        num_workers: int = 0,
        loader_cls: Callable[..., DataLoader[Any]] = DataLoader,
    ) -> None:
        super().__init__()
        if kind not in CORPUS_KINDS:
            raise ValueError(f"data.source must be one of synthetic, {', '.join(CORPUS_KINDS)}, got {kind!r}")
        tokens = open_corpus(path, kind)
        top = largest_token(tokens)
        if top >= vocab_size:
            raise ValueError(
                f"data.path: token id {top} does not fit the model's vocabulary of {vocab_size} "
                "(pick a model.preset with a larger one, e.g. gpt2, or set model.overrides.vocab_size)"
            )
        self.train_dataset = TokenWindows(tokens, seq_len, num_samples)
        self.batch_size, self.num_workers, self.loader_cls = batch_size, num_workers, loader_cls

    def train_dataloader(self) -> DataLoader[Any]:
        return self.loader_cls(
            self.train_dataset, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers, drop_last=True
        )
