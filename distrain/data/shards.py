"""Token shards on disk, nanoGPT-style: each split is several files of raw tokens (uint16 when the
vocabulary fits, else uint32) read as memory maps, beside an index.json and the tokenizer that wrote them.

    index.json     {"format", "dtype", "tokenizer": {kind, fingerprint, vocab_size, eos_id},
                    "splits": {"train"|"val": {"documents", "tokens", "shards": [{"file", "tokens", "crc32"}]}},
                    "source": {"path", "text_field", "files", "bytes"}, "val_fraction"}
    tokenizer.json (+ tokenizer_config.json)
    train_000000.bin ...  val_000000.bin ...

A shard's CRC-32 (of its bytes) lets a copy fetched from an object store be checked (data/remote.py); indexes
written before it was recorded have none, and are checked by size alone.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from distrain.config import ConfigError

# How token shards are made, for the messages that find none (the installed command; jobs/prepare_data.py in a clone).
PREPARE = "distrain prepare-data data.path=... tokenizer=bpe data.shards=DIR"

INDEX = "index.json"
FORMAT = 1
SPLITS = ("train", "val")


def dtype_for(vocab_size: int) -> np.dtype:
    """The smallest unsigned type holding every id: uint16 up to 65,536 tokens, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class ShardWriter:
    """Appends one split's tokens to files of at most `shard_tokens` tokens, holding none of them in memory."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.file: BinaryIO | None = None
        self.documents = 0

    def write(self, ids: Any) -> None:
        tokens = np.asarray(ids, dtype=self.dtype)
        while len(tokens):
            if self.file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._next_file()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            tokens[:room].tofile(self.file)
            self.shards[-1]["tokens"] += len(tokens[:room])
            self.shards[-1]["crc32"] = zlib.crc32(tokens[:room].tobytes(), self.shards[-1]["crc32"])
            tokens = tokens[room:]

    def _next_file(self) -> None:
        self.close()
        name = f"{self.split}_{len(self.shards):06d}.bin"
        self.file = open(self.directory / name, "wb")  # noqa: SIM115  (closed by close())
        self.shards.append({"file": name, "tokens": 0, "crc32": 0})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def summary(self) -> dict[str, Any]:
        return {"documents": self.documents, "tokens": sum(s["tokens"] for s in self.shards), "shards": self.shards}


def read_index(directory: str | Path) -> dict[str, Any]:
    """The shards' index, checked against the files beside it; a ConfigError naming data.shards otherwise."""
    directory = Path(directory)
    where = f"data.shards={str(directory)!r}"
    if not directory.is_dir():
        raise ConfigError(f"{where} does not exist; write it with {PREPARE}")
    if not (directory / INDEX).is_file():
        raise ConfigError(f"{where} has no {INDEX}: not prepared; run {PREPARE}")
    try:
        text = (directory / INDEX).read_text()
    except OSError as e:
        raise ConfigError(f"{where} is corrupt ({type(e).__name__}: {e}); prepare it again") from None
    sizes = {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}
    return parse_index(text, where, sizes)


def parse_index(text: str | bytes, where: str, sizes: dict[str, int]) -> dict[str, Any]:
    """An index's text, checked against the sizes of the files beside it (`sizes`: name → bytes, a local
    folder's or an object store's listing); a ConfigError starting with `where` otherwise."""
    try:
        index = json.loads(text)
        tokenizer = index["tokenizer"]
        tokenizer["kind"], tokenizer["fingerprint"], tokenizer["vocab_size"]  # noqa: B018  (present)
        for name, size in shard_sizes(index).items():
            if name not in sizes:
                raise FileNotFoundError(f"{name} is missing")
            if sizes[name] != size:
                raise ValueError(
                    f"{name} holds {sizes[name]} bytes, the index says {size // index_itemsize(index)} tokens"
                )
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ConfigError(f"{where} is corrupt ({type(e).__name__}: {e}); prepare it again") from None
    if index.get("format") != FORMAT:
        raise ConfigError(f"{where} has format {index.get('format')!r}, this distrain reads {FORMAT}; prepare it again")
    return index


def index_itemsize(index: dict[str, Any]) -> int:
    return np.dtype(index["dtype"]).itemsize


def shard_sizes(index: dict[str, Any]) -> dict[str, int]:
    """Every shard file the index names → its size in bytes."""
    return {
        s["file"]: s["tokens"] * index_itemsize(index) for split in SPLITS for s in index["splits"][split]["shards"]
    }


def open_split(directory: str | Path, split: str) -> list[np.ndarray]:
    """A split's shards as read-only memory maps: nothing is read until a window is gathered."""
    index = read_index(directory)
    dtype = np.dtype(index["dtype"])
    files = index["splits"][split]["shards"]
    return [np.memmap(Path(directory) / s["file"], dtype=dtype, mode="r") for s in files]
