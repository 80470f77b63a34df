"""Text → token shards (what `jobs/prepare_data.py` runs): the corpus streamed once to train a BPE when
none is given, once more to encode it; each document goes whole to the train or the validation split,
every (1 / data.val_fraction)-th to validation, so the split is the same on every run. Written into a
temporary directory renamed into place at the end: a shards directory is complete or absent."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distrain.config import ConfigError
from distrain.data.corpus import corpus_files
from distrain.data.documents import PIECE_BYTES, Piece, pieces
from distrain.data.shards import FORMAT, INDEX, ShardWriter, dtype_for
from distrain.data.tokenizer import Tokenizer, config_tokenizer, train_bpe
from distrain.progress import WorkLine

if TYPE_CHECKING:
    from distrain.config import TrainConfig

SHARD_TOKENS = 1 << 26  # 64 Mi tokens a file: 128 MiB of uint16
BATCH_BYTES = 1 << 18  # text encoded at once (its ids, as Python ints, take ~15× its size): the threads share it


def is_validation(unit: int, val_fraction: float) -> bool:
    """Every (1/val_fraction)-th unit, spread evenly, the first halfway through the first period: of the
    first n units, n · val_fraction rounded go to validation (one from n = 10 on at 0.05)."""
    return math.floor((unit + 1) * val_fraction + 0.5) > math.floor(unit * val_fraction + 0.5)


def prepare(
    cfg: TrainConfig,
    out: str | Path,
    shard_tokens: int = SHARD_TOKENS,
    piece_bytes: int = PIECE_BYTES,
    progress_s: float = 10.0,
) -> dict[str, Any]:
    """Write the shards of cfg.data.path, tokenized as cfg.tokenizer says, to `out`; returns their index."""
    out, d = Path(out), cfg.data
    if out.exists():
        raise ConfigError(f"data.shards={str(out)!r} already exists; choose a new directory or remove it")
    if not 0 < d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={d.val_fraction}: must be in (0, 1)")
    files = corpus_files(d.path)
    if not files:
        raise ConfigError(f"data.path={d.path!r} matches no files; give an existing directory or glob of text files")
    total = sum(os.path.getsize(f) for f in files)

    def corpus(label: str) -> Iterator[Piece]:
        line = WorkLine(label, total, progress_s)
        for piece in pieces(files, d.text_field, piece_bytes):
            line.update(piece.read)
            yield piece
        line.update(total, final=True)

    tokenizer = config_tokenizer(cfg)
    if tokenizer is None:
        tokenizer = train_bpe((p.text for p in corpus("training BPE")), cfg.tokenizer.vocab_size)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        index = _write(tmp, tokenizer, corpus("tokenizing"), d.val_fraction, shard_tokens)
        index["source"] = {"path": d.path, "text_field": d.text_field, "files": len(files), "bytes": total}
        (tmp / INDEX).write_text(json.dumps(index, indent=1))
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


def _write(
    directory: Path, tokenizer: Tokenizer, corpus: Iterator[Piece], val_fraction: float, shard_tokens: int
) -> dict[str, Any]:
    """Encode the pieces batch by batch, each to its split's files; the tokenizer saved beside them."""
    dtype = dtype_for(tokenizer.vocab_size)
    writers = [ShardWriter(directory, split, dtype, shard_tokens) for split in ("train", "val")]
    unit = 0
    for batch in _batches(corpus):
        for piece, ids in zip(batch, tokenizer.encode_batch([p.text for p in batch]), strict=True):
            writer = writers[is_validation(unit, val_fraction)]
            writer.write(ids)
            if piece.last and tokenizer.eos_id is not None:
                writer.write([tokenizer.eos_id])
            writer.documents += 1
            unit += 1
    for w in writers:
        w.close()
    train, val = (w.summary() for w in writers)
    for name, split in (("train", train), ("validation", val)):
        if not split["tokens"]:
            raise ConfigError(
                f"the {name} split is empty ({unit} documents, data.val_fraction={val_fraction:g}); add text, "
                f"or move data.val_fraction away from 0 or 1"
            )
    tokenizer.save(directory)
    return {
        "format": FORMAT,
        "dtype": dtype.name,
        "tokenizer": {
            "kind": tokenizer.kind,
            "fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
        },
        "splits": {"train": train, "val": val},
        "val_fraction": val_fraction,
    }


def _batches(corpus: Iterator[Piece]) -> Iterator[list[Piece]]:
    """Consecutive pieces, about BATCH_BYTES of text at a time."""
    batch, size = [], 0
    for piece in corpus:
        batch.append(piece)
        size += len(piece.text)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
