"""Text files → one stream of byte tokens (vocabulary 256: nothing to download)."""

from __future__ import annotations

import functools
import glob
import os
import sysconfig

import numpy as np


def stdlib_files() -> list[str]:
    """The running Python's standard-library source, without site-packages (whose contents differ
    from machine to machine); sorted so the corpus is the same wherever the Python is."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        files.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files)


def corpus_files(path: str | None) -> list[str]:
    """Files of a directory (recursively) or a glob; the stdlib source when path is None."""
    if path is None:
        return stdlib_files()
    pattern = os.path.join(path, "**", "*") if os.path.isdir(path) else path
    return sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))


def load_tokens(path: str | None) -> np.ndarray:
    """The corpus as uint8 tokens: the files' bytes, concatenated in sorted order. Kept in the
    process while its files are unchanged: a worker that trains again (after a restart, in the next
    run, or a hot spare warming up) does not read them again."""
    files = corpus_files(path)
    if not files:
        raise FileNotFoundError(f"data.path={path!r} matches no files")
    return _read(tuple((f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files))


@functools.lru_cache(maxsize=2)
def _read(files: tuple[tuple[str, int, int], ...]) -> np.ndarray:
    data = bytearray()
    for f, _, _ in files:
        with open(f, "rb") as fh:
            data += fh.read()
    return np.frombuffer(data, dtype=np.uint8)  # shared by every caller: read, never written


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy of the byte distribution in nats: the loss of a model that ignores context."""
    p = np.bincount(tokens, minlength=256) / len(tokens)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())
