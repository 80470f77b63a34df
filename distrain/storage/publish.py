"""A folder a one-process job writes (token shards, an exported model) sent to an object store when its output
is a URL: the job writes a local folder as it always does, in a temporary place under `storage.cache_dir`, then
every file is uploaded and one chosen file LAST. A reader takes that file as the sign the rest is there (the
shards' index, a model's config.json), so an upload cut short never looks complete; and since a complete
output is never overwritten, only a URL without that file is written to."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from distrain.config import ConfigError
from distrain.storage.objectstore import StorageError, store_for
from distrain.urls import check_location

if TYPE_CHECKING:
    from distrain.config import StorageConfig


@contextmanager
def staged(url: str, storage: StorageConfig, last: tuple[str, ...], key: str) -> Iterator[Path]:
    """A local path (absent) to write the output to; once the block ends without error, its files are
    uploaded to `url`, those of `last` written (the files that mark an output complete: a model's config, or an
    adapter's) after all others. A one-line ConfigError naming `key` before anything is written when the URL is
    not well-formed, its bucket does not exist (unless storage.create_bucket), it already holds a complete output
    or cannot be written, and if the upload fails."""
    try:
        check_location(url, key)
        store = store_for(url, storage)
        store.check_bucket(f"{key}={url!r}", storage.create_bucket)
        complete = next((name for name in last if store.exists(name)), None)
        if not complete:
            if "file" in store.fs.protocol:  # a folder, which must exist to hold files (an object store has none)
                store.fs.makedirs(store.root, exist_ok=True)
            store.check_writable()
    except (StorageError, OSError) as e:
        raise ConfigError(f"{key}={url} cannot be written: {e}") from None
    except ValueError as e:  # not a well-formed URL, no filesystem for it, no such bucket
        raise ConfigError(str(e)) from None
    if complete:
        raise ConfigError(f"{key}={url} already holds a complete output ({complete}); choose a new URL or remove it")
    parent = Path(storage.cache_dir).expanduser() / "staging"
    parent.mkdir(parents=True, exist_ok=True)
    local = Path(tempfile.mkdtemp(dir=parent))
    try:
        yield local / "out"
        names = sorted(str(p.relative_to(local / "out")) for p in (local / "out").rglob("*") if p.is_file())
        marks = [n for n in names if n in last]
        if not marks:
            raise ConfigError(f"{key}={url}: the output has no {' or '.join(last)}; nothing was uploaded")
        try:
            store.upload(local / "out", [n for n in names if n not in marks], "")
            store.upload(local / "out", marks, "")
        except StorageError as e:
            raise ConfigError(
                f"{key}={url}: the upload failed, {', '.join(marks)} not written (the output is incomplete): {e}"
            ) from None
    finally:
        shutil.rmtree(local, ignore_errors=True)
