"""Data: the global batch is a function of (seed, step) alone, sliced the same way by any world size."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from distrain.data.corpus import corpus_files, load_tokens, stdlib_files, unigram_entropy
from distrain.data.loader import VAL, Batches, split


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=50_000, dtype=np.uint8)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_global_batch_is_the_same_whatever_the_world_size(tokens, world):
    batches = Batches(tokens, seq_len=16, batch_size=8, seed=1)
    whole_x, whole_y = batches.get(step=5)
    parts = [batches.get(step=5, rank=r, world=world) for r in range(world)]
    assert torch.equal(torch.cat([x for x, _ in parts]), whole_x)
    assert torch.equal(torch.cat([y for _, y in parts]), whole_y)


def test_batches_are_deterministic_per_step_and_targets_are_shifted(tokens):
    a, b = Batches(tokens, 16, 8, seed=1), Batches(tokens, 16, 8, seed=1)
    x, y = a.get(3)
    assert torch.equal(x, b.get(3)[0])
    assert not torch.equal(x, a.get(4)[0])
    assert not torch.equal(x, Batches(tokens, 16, 8, seed=2).get(3)[0])
    assert not torch.equal(x, Batches(tokens, 16, 8, seed=1, stream=VAL).get(3)[0])
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert x.dtype == torch.int64 and x.shape == (8, 16)


def test_split_is_disjoint_and_rejects_too_little_text(tokens):
    s = split(tokens, val_fraction=0.1, seq_len=16)
    assert len(s.train) + len(s.val) == len(tokens)
    assert np.array_equal(np.concatenate([s.train, s.val]), tokens)
    with pytest.raises(ValueError, match="seq_len"):
        split(tokens[:100], val_fraction=0.1, seq_len=16)


def test_stdlib_corpus_is_sorted_real_text_without_site_packages():
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 500
    assert not any("site-packages" in f for f in files)
    assert any(f.endswith("/os.py") for f in files)


def test_user_text_directory_and_glob(tmp_path: Path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("hello ")
    (tmp_path / "sub" / "b.txt").write_text("world")
    (tmp_path / "c.md").write_text("!")
    assert bytes(load_tokens(str(tmp_path))) == b"hello !world"  # sorted: a.txt, c.md, sub/b.txt
    assert corpus_files(str(tmp_path / "*.txt")) == [str(tmp_path / "a.txt")]
    with pytest.raises(FileNotFoundError, match="data.path"):
        load_tokens(str(tmp_path / "missing"))


def test_unigram_entropy():
    assert unigram_entropy(np.arange(256, dtype=np.uint8)) == pytest.approx(math.log(256))
    assert unigram_entropy(np.zeros(10, dtype=np.uint8)) == 0
