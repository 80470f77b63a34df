"""Run storage on an object store: `run.storage=s3://bucket/prefix`, or any fsspec URL (gs://, az://, file://).

Clusters in the cloud seldom share a POSIX filesystem; their durable storage is an object store. Every
process keeps working in a local mirror of the run directory (`storage.cache_dir`, on its own node: fast
writes, memory-mapped reads, today's code), and the object store holds the durable copy: checkpoints are
uploaded by the ranks that wrote them and committed there (storage/remote.py), the run record is uploaded
as it grows. A `Store` is one prefix of the object store with the few operations that needs, each retried
with back-off: objects have no rename, so nothing here relies on one (a commit is a marker written last).

Credentials never pass through distrain's config: fsspec reads them from the standard places (the
environment, ~/.aws, instance metadata); `storage.options` holds the filesystem's other options (an
endpoint), and is redacted wherever a config is recorded.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from distrain.urls import URL, bucket

T = TypeVar("T")
# The clients' lines on every client made ("Found credentials in environment variables.", "Found endpoint for s3
# via: environment_global."): not the run's.
QUIET_LOGGERS = ("aiobotocore.credentials", "botocore.credentials", "botocore.configprovider")
# Where a store ignores conditional writes: how long a created object must stay as written to be held (create()).
SETTLE_S = 1.0


class StorageError(RuntimeError):
    """The object store could not do what was asked after every retry: one line naming the URL and why."""


class Store:
    """One prefix of an object store. Names are relative to it ('checkpoints/step_00000010/meta.json');
    every operation is retried `retries` times with doubling back-off from `backoff_s`, then StorageError."""

    def __init__(self, url: str, options: dict | None = None, retries: int = 4, backoff_s: float = 0.5):
        from fsspec.core import url_to_fs

        for name in QUIET_LOGGERS:  # here, after any logging config (Hydra's) has set the levels
            logging.getLogger(name).setLevel(logging.WARNING)
        self.url, self.options = url.rstrip("/"), dict(options or {})
        self.retries, self.backoff_s = retries, backoff_s
        # file://: a folder's files need their folders (an object store has none), made as they are written
        local = {"auto_mkdir": True} if URL.match(self.url)[1] in ("file", "local") else {}
        self.fs, self.root = url_to_fs(self.url, **local, **self.options)
        self.root = self.root.rstrip("/")
        self._conditional: bool | None = None  # conditional_writes(), once asked

    def __reduce__(self):  # what crosses into a Ray actor: the URL and options, never a live client
        return Store, (self.url, self.options, self.retries, self.backoff_s)

    def child(self, *parts: str) -> Store:
        return Store("/".join([self.url, *parts]), self.options, self.retries, self.backoff_s)

    def _path(self, name: str = "") -> str:
        return f"{self.root}/{name}" if name else self.root

    def _retry(self, what: str, fn: Callable[[], T], name: str = "") -> T:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except Exception as e:  # the clients raise their own classes (botocore, aiohttp, OSError)
                if attempt == self.retries:
                    where = f"{self.url}/{name}" if name else self.url
                    raise StorageError(f"{what} {where} failed after {self.retries + 1} tries: {_first(e)}") from e
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    # -- listing -----------------------------------------------------------------------------------

    def listing(self, prefix: str = "") -> dict[str, int]:
        """Every object under `prefix`, at any depth: its name relative to `prefix` → its size."""
        base = self._path(prefix)

        def ls() -> dict[str, int]:
            self.fs.invalidate_cache()
            found = self.fs.find(base, detail=True) if self.fs.exists(base) else {}
            return {p[len(base) + 1 :]: int(info["size"]) for p, info in found.items() if info["type"] == "file"}

        return self._retry("listing", ls, prefix)

    def children(self, prefix: str = "") -> list[str]:
        """The names of the 'directories' directly under `prefix`."""
        base = self._path(prefix)

        def ls() -> list[str]:
            self.fs.invalidate_cache()
            if not self.fs.exists(base):
                return []
            return sorted(
                e["name"].rstrip("/").rsplit("/", 1)[-1]
                for e in self.fs.ls(base, detail=True)
                if e["type"] == "directory"
            )

        return self._retry("listing", ls, prefix)

    def exists(self, name: str) -> bool:
        def look() -> bool:
            self.fs.invalidate_cache()
            return self.fs.exists(self._path(name))

        return self._retry("looking up", look, name)

    # -- objects -----------------------------------------------------------------------------------

    def read_bytes(self, name: str) -> bytes:
        return self._retry("reading", lambda: self.fs.cat_file(self._path(name)), name)

    def write_bytes(self, name: str, data: bytes) -> None:
        self._retry("writing", lambda: self.fs.pipe_file(self._path(name), data), name)

    def create(self, name: str, data: bytes) -> bool:
        """Write `name` only if no object has that name (a conditional write: S3's If-None-Match, GCS's
        ifGenerationMatch=0, Azure's If-None-Match: *, local O_EXCL); False if one has. The run's lock: two drivers
        can never both create it. A store that ignores the condition (`conditional_writes`: the GCS emulator) gets
        a check instead: an object there refuses, and one written must read back as written after SETTLE_S, by
        when a second driver's write begun in the same instant has landed."""
        if not self.conditional_writes():
            return self._create_checked(name, data)
        return self._retry("creating", lambda: self._create_if_absent(name, data), name)

    def _create_if_absent(self, name: str, data: bytes) -> bool:
        try:
            with self.fs.open(self._path(name), "xb") as f:
                f.write(data)
            return True
        except FileExistsError:
            return False
        except OSError as e:  # s3fs reports the failed precondition as EINVAL
            if "pre-condition" in str(e) or "PreconditionFailed" in str(e):
                return False
            raise

    def conditional_writes(self) -> bool:
        """Whether the store refuses a conditional write over an object that exists; asked once per Store, with
        an object of its own created twice."""
        if self._conditional is None:
            probe = f".distrain-probe-{uuid.uuid4().hex[:12]}"
            first = self._retry("creating", lambda: self._create_if_absent(probe, b"1"), probe)
            again = self._retry("creating", lambda: self._create_if_absent(probe, b"2"), probe)
            self.remove(probe)
            self._conditional = first and not again
        return self._conditional

    def _create_checked(self, name: str, data: bytes) -> bool:
        if self.exists(name):
            return False
        self.write_bytes(name, data)
        time.sleep(SETTLE_S)
        try:
            return self.read_bytes(name) == data
        except FileNotFoundError:  # removed by its other writer, which then holds nothing either
            return False

    def upload(self, local_dir: Path, names: Iterable[str], prefix: str) -> None:
        """Copy each named file of `local_dir` to `prefix/name` (to `name` with an empty prefix)."""
        for name in names:
            where = f"{prefix}/{name}" if prefix else name
            self._retry(
                "uploading to", lambda n=name, w=where: self.fs.put_file(str(local_dir / n), self._path(w)), where
            )

    def download(self, names: Iterable[str], prefix: str, local_dir: Path) -> None:
        """Copy each object `prefix/name` (`name` with an empty prefix) to `local_dir/name`, written under a
        temporary name then renamed: a download cut short never leaves a whole-looking file."""
        local_dir.mkdir(parents=True, exist_ok=True)
        for name in names:
            target = local_dir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            part = target.with_name(f".{target.name}.part-{uuid.uuid4().hex[:8]}")

            where = f"{prefix}/{name}" if prefix else name

            def get(where: str = where, part: Path = part, target: Path = target) -> None:
                self.fs.get_file(self._path(where), str(part))
                part.replace(target)

            self._retry("downloading", get, where)

    def remove(self, name: str) -> None:
        """Delete `name`, and everything under it if it is a prefix; nothing if it is absent."""

        def rm() -> None:
            self.fs.invalidate_cache()
            if self.fs.exists(self._path(name)):
                self.fs.rm(self._path(name), recursive=True)

        self._retry("deleting", rm, name)

    def check_writable(self) -> None:
        """StorageError in one line unless an object can be written, read back and deleted under the prefix:
        what a run needs, checked before any worker starts."""
        probe = f".distrain-probe-{uuid.uuid4().hex[:12]}"
        self.write_bytes(probe, b"probe")
        if self.read_bytes(probe) != b"probe":
            raise StorageError(f"{self.url}: an object written there read back different")
        self.remove(probe)

    def check_bucket(self, setting: str, create: bool, make: bool = True) -> bool:
        """ValueError in one line naming `setting` when the URL's bucket does not exist, unless `create`: then it
        is made (with `make`; without, a plan's look: False, it would be). Checked before the first write, as a
        store that makes buckets on write (SeaweedFS) would take a misspelt name for a new one. A bucket this
        client may not look at is left to the write that follows. Whether the bucket is there now."""
        name = bucket(self.url)
        if not name:
            return True

        def look() -> bool:
            self.fs.invalidate_cache()
            try:
                self.fs.info(name)  # S3's HeadBucket
            except FileNotFoundError:
                return False
            except PermissionError:
                pass
            return True

        if self._retry("looking up the bucket of", look):
            return True
        if not create:
            raise ValueError(
                f"{setting}: the bucket {name!r} does not exist; check its name, or set storage.create_bucket=true "
                f"to create it"
            )
        if make:
            self._retry("creating the bucket of", lambda: self.fs.makedirs(name, exist_ok=True))
        return make


def _first(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def delete_command(url: str) -> str:
    """How a user deletes the object at `url` by hand: its cloud's command line."""
    tool = {"s3": "aws s3 rm", "s3a": "aws s3 rm", "gs": "gcloud storage rm", "gcs": "gcloud storage rm"}
    scheme = URL.match(url)[1]
    return f"{tool[scheme]} {url} (or your store's tool)" if scheme in tool else f"delete {url} with your store's tool"


def quick_options(url: str, options: dict) -> dict:
    """`options` for a check that must fail fast: a fresh client (not one cached with an older environment),
    and for S3 short timeouts and one try (botocore's defaults take ~8 s per try against a closed port)."""
    quick = {**options, "skip_instance_cache": True}
    if URL.match(url)[1] in ("s3", "s3a"):
        quick["config_kwargs"] = {
            "connect_timeout": 3,
            "read_timeout": 10,
            "retries": {"max_attempts": 1},
            **options.get("config_kwargs", {}),
        }
    return quick


def store_for(url: str, storage: Any) -> Store:
    """The Store of `url` with the run's `storage` config (StorageConfig: its options and retry policy)."""
    return Store(url, storage.options, storage.retries, storage.backoff_s)
