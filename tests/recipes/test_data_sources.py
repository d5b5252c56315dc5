"""``pretrain_gpt`` on real data: a nanoGPT-style ``uint16`` token file or a text file read byte by byte (small
corpora generated here), the GPT-2-small preset, and the errors that name the bad setting."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recipes._corpus import CorpusDataModule, TokenWindows, open_corpus
from recipes._gpt import TinyGPT, count_parameters, gpt_preset
from tests.recipes.test_recipes import _run

RECIPE = [sys.executable, "-m", "lightning_resilience.recipes.pretrain_gpt"]
WORDS = [
    "the",
    "a",
    "resilient",
    "job",
    "saves",
    "its",
    "state",
    "every",
    "step",
    "and",
    "resumes",
    "where",
    "it",
    "stopped",
    "after",
    "any",
    "fault",
]


def _text(path: Path, n_words: int = 6000) -> Path:
    rng = random.Random(0)
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(n_words)) + "\n")
    return path


def _tokens(path: Path, n: int = 20_000, vocab: int = 256) -> Path:
    np.random.default_rng(0).integers(0, vocab, n, dtype=np.uint16).tofile(path)  # nanoGPT's train.bin layout
    return path


def test_windows_cover_the_file_with_shifted_targets(tmp_path: Path) -> None:
    tokens = open_corpus(_tokens(tmp_path / "train.bin", n=101), "tokens")
    windows = TokenWindows(tokens, seq_len=10)
    assert len(windows) == 10 and len(TokenWindows(tokens, seq_len=10, num_samples=3)) == 3
    assert torch.equal(windows[1], torch.from_numpy(tokens[10:21].astype(np.int64)))
    assert windows[1][0] == windows[0][-1]  # consecutive windows share one token: every target is predicted once
    text = open_corpus(_text(tmp_path / "book.txt"), "text")
    assert text.dtype == np.uint8 and bytes(text[:4]) == (tmp_path / "book.txt").read_bytes()[:4]


def test_gpt2_preset_is_gpt2_small() -> None:
    with torch.device("meta"):
        model = TinyGPT(**gpt_preset("gpt2"))
    assert count_parameters(model) == 124_475_904
    assert gpt_preset("gpt2")["vocab_size"] == 50304 and gpt_preset("gpt2")["seq_len"] == 1024


@pytest.mark.parametrize("source", ["text", "tokens"])
def test_recipe_trains_on_a_file(tmp_path: Path, source: str) -> None:
    path = _text(tmp_path / "book.txt") if source == "text" else _tokens(tmp_path / "train.bin")
    run = tmp_path / "run"
    proc = _run([*RECIPE, f"run_dir={run}", f"data.source={source}", f"data.path={path}", "trainer.max_steps=6",
                 "resilience=minimal"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run / "report.jsonl").read_text().splitlines()[-1])
    assert report["final_step"] == 6 and report["final_loss"] is not None


def test_ids_beyond_the_vocabulary_and_misplaced_keys_fail_naming_them(tmp_path: Path) -> None:
    path = _tokens(tmp_path / "train.bin", vocab=50_000)
    with pytest.raises(ValueError, match=r"data.path: token id \d+ does not fit the model's vocabulary of 256"):
        CorpusDataModule(str(path), "tokens", vocab_size=256)
    assert len(CorpusDataModule(str(path), "tokens", vocab_size=50304).train_dataset) > 0
    with pytest.raises(ValueError, match=r"data\.path: no such file"):
        open_corpus(tmp_path / "missing.bin", "tokens")
    bad = _run([*RECIPE, f"run_dir={tmp_path / 'r'}", "data.source=tokens", f"data.path={path}", "data.seed=3"])
    assert bad.returncode != 0 and "data.seed applies to synthetic data only" in bad.stderr
