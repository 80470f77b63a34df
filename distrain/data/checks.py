"""The data's rules, checked in the driver before any worker starts (called from distrain/driver/validation.py
and, for a resume, from rerun.check_resumable): each broken one a one-line ConfigError."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from distrain.config import ConfigError
from distrain.data.shards import PREPARE, read_index
from distrain.data.tokenizer import load_tokenizer
from distrain.storage.objectstore import StorageError
from distrain.urls import is_url

if TYPE_CHECKING:
    from distrain.config import TrainConfig

TOKENIZER = "tokenizer.json"


def check_data(cfg: TrainConfig) -> None:
    """Token shards (a folder, or a URL whose index is read there) that exist, are whole, come from the
    tokenizer the config names, fit the model's vocabulary and hold a window of trainer.seq_len in each split;
    a BPE only through shards."""
    d, t = cfg.data, cfg.tokenizer
    if t.name not in (None, "bytes", "bpe"):
        raise ConfigError(f"tokenizer.name={t.name!r}: choose bytes or bpe (tokenizer=bytes, tokenizer=bpe)")
    if not d.shards:
        if t.name == "bpe":
            raise ConfigError(f"tokenizer=bpe trains on token shards: run {PREPARE}, then train with data.shards=DIR")
        return
    index, stored = shards_index(cfg)
    where, tok = f"data.shards={d.shards!r}", index["tokenizer"]
    if stored is None or hashlib.sha256(stored).hexdigest() != tok["fingerprint"]:
        raise ConfigError(f"{where} is corrupt: its tokenizer.json is missing or not the one its tokens were made with")
    if t.name is not None and t.name != tok["kind"]:
        raise ConfigError(
            f"{where} was tokenized with tokenizer={tok['kind']}, this config names tokenizer={t.name}: set "
            f"tokenizer={tok['kind']}, or prepare shards with tokenizer={t.name}"
        )
    if t.path and load_tokenizer(t.path).fingerprint != tok["fingerprint"]:
        raise ConfigError(
            f"{where} was written by another tokenizer than tokenizer.path={t.path!r}: prepare the shards with "
            f"that tokenizer.path, or leave tokenizer.path unset to train with the shards' own"
        )
    vocab, model_vocab = tok["vocab_size"], cfg.model.vocab_size
    if vocab > model_vocab:
        raise ConfigError(
            f"{where} holds a tokenizer of {vocab} tokens, more than model.vocab_size={model_vocab}: "
            f"set model.vocab_size={vocab}"
        )
    seq_len = cfg.trainer.seq_len
    for split, name in (("train", "training"), ("val", "validation")):
        if not any(s["tokens"] > seq_len + 1 for s in index["splits"][split]["shards"]):
            raise ConfigError(
                f"{where}: no {name} shard holds more than trainer.seq_len+1={seq_len + 1} tokens; lower "
                f"trainer.seq_len, or prepare more text (or a larger data.val_fraction)"
            )


def shards_index(cfg: TrainConfig) -> tuple[dict, bytes | None]:
    """data.shards' index and its tokenizer.json (None if absent), read where they are: on an object store
    without fetching a shard (the index is checked against the store's listing)."""
    if is_url(cfg.data.shards):
        from distrain.data.remote import remote_index

        index, listing, store = remote_index(cfg.data.shards, cfg.storage)
        try:
            return index, store.read_bytes(TOKENIZER) if TOKENIZER in listing else None
        except StorageError as e:
            raise ConfigError(f"data.shards={cfg.data.shards!r} cannot be read: {e}") from None
    stored = Path(cfg.data.shards) / TOKENIZER
    return read_index(cfg.data.shards), stored.read_bytes() if stored.is_file() else None


def check_same_shards(saved: dict, current: dict) -> None:
    """A resume reads the shards its checkpoint's run read: other tokens would not continue that run
    (and other ids could mean other words)."""
    old, new = saved["data"].get("shards"), current["data"].get("shards")
    if old != new and (old is None or new is None or os.path.realpath(old) != os.path.realpath(new)):
        raise ConfigError(
            f"run {current['run']['name']!r} was trained with data.shards={old!r}, this config has {new!r}: "
            f"resume with the same data.shards, or start a new run.name"
        )
