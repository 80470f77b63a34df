"""A corpus as a stream of documents, never read whole: text files (a directory or a glob) and JSONL
files (one record per line, its text in `text_field`). A text file longer than `piece_bytes` comes in
pieces ending at a line end, so a file larger than memory streams too; the pieces are the units the
train/validation split deals out."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass

from distrain.config import ConfigError

PIECE_BYTES = 1 << 16  # a text file's piece: small enough to deal out a small corpus over both splits


@dataclass(frozen=True)
class Piece:
    text: str
    last: bool  # the end of a document: a tokenizer with an end-of-text token appends it here
    read: int  # bytes of the corpus read so far, for the progress display


def is_jsonl(file: str) -> bool:
    return file.endswith(".jsonl")


def pieces(files: list[str], text_field: str, piece_bytes: int = PIECE_BYTES) -> Iterator[Piece]:
    """Every document of `files`, in order, as pieces of at most about `piece_bytes` bytes."""
    read = 0
    for file in files:
        with open(file, "rb") as fh:
            for text, last, size in _jsonl(fh, file, text_field) if is_jsonl(file) else _text(fh, piece_bytes):
                read += size
                yield Piece(text, last, read)


def _jsonl(fh, file: str, text_field: str) -> Iterator[tuple[str, bool, int]]:
    for number, line in enumerate(fh, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)[text_field]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(
                f"{file}:{number} is not a JSON object with a {text_field!r} field; set data.text_field to the "
                f"field holding the text"
            ) from None
        if not isinstance(text, str):
            raise ConfigError(
                f"{file}:{number}: data.text_field={text_field!r} holds a {type(text).__name__}, not text"
            )
        yield text, True, len(line)


def _text(fh, piece_bytes: int) -> Iterator[tuple[str, bool, int]]:
    """Lines (each read at most `piece_bytes` at a time) gathered into pieces; invalid UTF-8 becomes U+FFFD."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    parts: list[str] = []
    size = 0
    for line in iter(lambda: fh.readline(piece_bytes), b""):
        parts.append(decoder.decode(line))
        size += len(line)
        if size >= piece_bytes:
            yield "".join(parts), False, size
            parts, size = [], 0
    yield "".join(parts) + decoder.decode(b"", final=True), True, size
