"""Token shards on an object store (`data.shards=s3://bucket/prefix`, any fsspec URL): the driver checks their
index where it is, without fetching a shard; each node fetches them once into a local cache
(`storage.cache_dir`), where its ranks memory-map them as they would a local folder.

The ranks of a node share the cache under an exclusive lock (fcntl.flock on a file in it): the first fetches,
the others find the files there. A cached file is trusted while its size and modification time are those
recorded when it was last checked against the index (size, and CRC-32 where the index has one); any other
file is checked again, and fetched again if it does not match: a partial or damaged cache mends itself.
Downloads are written under a temporary name and renamed (Store.download)."""

from __future__ import annotations

import fcntl
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distrain.config import ConfigError
from distrain.data.shards import INDEX, PREPARE, SPLITS, parse_index, shard_sizes
from distrain.storage.fsutil import atomic_write
from distrain.storage.integrity import checksum
from distrain.storage.objectstore import StorageError, Store, store_for
from distrain.urls import check_location, is_url, mirror_dir

if TYPE_CHECKING:
    from distrain.config import StorageConfig, TrainConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
LOCK, CHECKED = ".fetch.lock", ".checked.json"  # in the cache folder: the node's lock, what was last verified


def remote_index(url: str, storage: StorageConfig) -> tuple[dict[str, Any], dict[str, int], Store]:
    """The index at `url`, checked against the store's listing (every shard there, of its size), the listing,
    and the store; a one-line ConfigError naming the URL when it is unreachable, unprepared or corrupt."""
    where = f"data.shards={url!r}"
    try:
        check_location(url, "data.shards")
        store = store_for(url, storage)
        text = store.read_bytes(INDEX)
        listing = store.listing()
    except FileNotFoundError:
        raise ConfigError(
            f"{where} has no {INDEX}: not prepared (or an upload never finished); run {PREPARE}"
        ) from None
    except StorageError as e:
        raise ConfigError(f"{where} cannot be read: {e}") from None
    except ValueError as e:  # no filesystem for the scheme
        raise ConfigError(str(e)) from None
    except Exception as e:  # the filesystem's own (a bad endpoint, no credentials) before any retry
        raise ConfigError(f"{where} cannot be read: {type(e).__name__}: {str(e).strip().splitlines()[0]}") from None
    return parse_index(text, where, listing), listing, store


def local_shards(cfg: TrainConfig, tokenizer_only: bool = False) -> str:
    """The folder to read data.shards from on this node: itself, or for a URL its cache, fetched first (only
    the tokenizer's files with `tokenizer_only`)."""
    if not is_url(cfg.data.shards):
        return cfg.data.shards
    return str(fetch(cfg.data.shards, cfg.storage, tokenizer_only)[0])


def fetch(url: str, storage: StorageConfig, tokenizer_only: bool = False) -> tuple[Path, list[str]]:
    """The shards at `url` in this node's cache, and the names fetched into it this time (none when the cache
    already held them whole). The index is written last: a cache folder with an index is complete."""
    index, listing, store = remote_index(url, storage)
    wanted = {name: (listing[name], None) for name in TOKENIZER_FILES if name in listing}
    if not tokenizer_only:
        crcs = {s["file"]: s.get("crc32") for split in SPLITS for s in index["splits"][split]["shards"]}
        wanted |= {name: (size, crcs[name]) for name, size in shard_sizes(index).items()}
    cache = mirror_dir(url, storage.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        for leftover in cache.glob(".*.part-*"):  # a download a killed rank left: no one else writes here now
            leftover.unlink()
        checked = _read_checked(cache)
        stale = [name for name, want in wanted.items() if not _whole(cache / name, want, checked)]
        if stale:
            started = time.monotonic()
            try:
                store.download(stale, "", cache)
            except StorageError as e:
                raise ConfigError(f"data.shards={url!r}: fetching into {cache} failed: {e}") from None
            for name in stale:
                if not _whole(cache / name, wanted[name], checked):
                    raise ConfigError(
                        f"data.shards={url!r}: {name} as fetched does not match its index; prepare the shards again"
                    )
            size = sum(wanted[name][0] for name in stale) / 2**20
            print(
                f"distrain: fetched {len(stale)} files ({size:.1f} MiB) of data.shards={url} into {cache} in "
                f"{time.monotonic() - started:.1f} s",
                flush=True,
            )
        atomic_write(cache / CHECKED, json.dumps(checked))
        if not tokenizer_only:
            atomic_write(cache / INDEX, json.dumps(index, indent=1))
    return cache, stale


def _read_checked(cache: Path) -> dict[str, list[int]]:
    try:
        return json.loads((cache / CHECKED).read_text())
    except (OSError, ValueError):
        return {}


def _whole(path: Path, want: tuple[int, int | None], checked: dict[str, list[int]]) -> bool:
    """Whether the cached file has the size (and CRC-32) the index gives it. Checked once: its size and mtime
    then go in `checked` with the CRC seen, and while they stay the same it is not read again."""
    size, crc = want
    try:
        stat = path.stat()
    except FileNotFoundError:
        return False
    if stat.st_size != size:
        return False
    seen = checked.get(path.name)
    if seen is not None and seen[:2] == [stat.st_size, stat.st_mtime_ns] and (crc is None or seen[2] == crc):
        return True
    actual = checksum(path) if crc is not None else None
    if actual != crc:
        return False
    checked[path.name] = [stat.st_size, stat.st_mtime_ns, actual]
    return True
