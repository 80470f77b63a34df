"""Data: the global batch is a function of (seed, step) alone, sliced the same way by any world size;
tokenizers that round-trip and that transformers reads as they encode."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from distrain.config import ConfigError
from distrain.data.corpus import corpus_files, load_tokens, stdlib_files, unigram_entropy
from distrain.data.loader import TRAIN, VAL, Batches, split
from distrain.data.tokenizer import EOS, ByteTokenizer, load_tokenizer, train_bpe


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
    with pytest.raises(ValueError, match="batch of 8 does not split over 3 data-parallel ranks"):
        batches.get(step=5, rank=0, world=3)


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


def test_the_byte_corpus_batches_are_todays(tokens):
    """The default run's batches: windows at offsets drawn in [0, len - seq_len - 1), as before shards."""
    x, y = Batches(tokens, 16, 8, seed=1).get(7)
    starts = np.random.default_rng([1, TRAIN, 7]).integers(0, len(tokens) - 17, size=8)
    want = torch.from_numpy(tokens)[torch.from_numpy(starts)[:, None] + torch.arange(17)].long()
    assert torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:])


def test_windows_over_several_parts_stay_inside_one_and_cover_all(tokens):
    """Shards: a window never spans two files, every file with room for one gets some, and any world
    size slices the same global batch."""
    parts = [tokens[:1000].astype(np.uint16), tokens[1000:1010].astype(np.uint16), tokens[1010:3000].astype(np.uint16)]
    batches = Batches(parts, seq_len=16, batch_size=64, seed=3)
    x, y = batches.get(2)
    rows = {bytes(r.numpy().astype(np.uint8)) for r in torch.cat([x, y[:, -1:]], 1)}
    haystacks = [bytes(p.astype(np.uint8)) for p in parts]
    assert all(any(r in h for h in haystacks) for r in rows)
    assert all(any(r in h for r in rows) for h in (haystacks[0], haystacks[2]))
    halves = [batches.get(2, rank, 2)[0] for rank in range(2)]
    assert torch.equal(torch.cat(halves), x)


TEXTS = ["hello world\n  def foo(x):\n\treturn x  # héllo ✓ 中文 🙂\n", "", " a  b ", "\r\n\x00\x7f", "import os\n" * 9]


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def tokenizer(request):
    if request.param == "bytes":
        return ByteTokenizer()
    pytest.importorskip("tokenizers")
    return train_bpe(iter(TEXTS * 20), vocab_size=300)


def test_tokenizer_round_trips_and_transformers_encodes_the_same(tokenizer, tmp_path: Path):
    """Saved, it loads in transformers' AutoTokenizer (what an export ships) with the same ids, and in
    load_tokenizer with the same fingerprint; ids stay inside the vocabulary."""
    transformers = pytest.importorskip("transformers")
    tokenizer.save(tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert type(loaded) is type(tokenizer) and loaded.fingerprint == tokenizer.fingerprint
    assert loaded.vocab_size == tokenizer.vocab_size and loaded.eos_id == tokenizer.eos_id
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text and loaded.encode(text) == ids
        assert auto(text)["input_ids"] == ids and auto.decode(ids) == text
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert list(tokenizer.encode_batch([text])[0]) == ids
    if tokenizer.kind == "bytes":
        assert tokenizer.encode("é") == [0xC3, 0xA9] and tokenizer.vocab_size == 256
    else:
        assert len(tokenizer.encode("import os\n" * 9)) < len("import os\n" * 9)  # merges were learned
        assert auto.eos_token == EOS and tokenizer.eos_id == auto.convert_tokens_to_ids(EOS)


def test_load_tokenizer_refuses_what_is_not_one(tmp_path: Path):
    with pytest.raises(ConfigError, match="tokenizer.path=.*has no tokenizer.json"):
        load_tokenizer(tmp_path)
    pytest.importorskip("tokenizers")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a tokenizer.json"):
        load_tokenizer(tmp_path)


def test_bpe_without_tokenizers_says_how_to_install(monkeypatch):
    """The `hf` extra is optional: without it, a BPE fails in one line naming the install command."""
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # what Python does for a package not installed
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[hf\]"') as e:
        train_bpe(iter(TEXTS), 300)
    assert "\n" not in str(e.value)
