"""A run's record on an object store, and its lock there (run.storage=s3://…).

Every process writes the run's files in its local mirror, as on a shared directory; `RecordSync` uploads the
ones that changed (summary.json, placement, attempts, logs, the Hydra record, metrics, TensorBoard's and W&B's
files: everything but the checkpoints, which their own writer uploads and commits) every
storage.sync_interval_s on a thread and when asked (`sync`: at the end, at a checkpoint's commit), so the run
can be read from the store while it trains and is complete there after. A fresh mirror is filled from the
store first (`pull`), so a rerun on another machine keeps the run's history. Neither torch nor Ray.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from distrain.config import TrainConfig
from distrain.storage.fsutil import LockedError, alive
from distrain.storage.objectstore import SETTLE_S, StorageError, Store, delete_command, store_for

LOCK_OBJECT = ".lock"  # the run's exclusive lock on the store: one driver per run URL
NOT_RECORD = ("checkpoints",)  # uploaded and committed by the checkpoints' writer
SUMMARY = "summary.json"


class RecordSync:
    """Uploads the files of `run_dir` (of its entries `only`, if given; not of those in `skip`, whose writer
    uploads them) that changed since they were last uploaded or downloaded. Hidden files (a lock, a write's
    temporary name) are never part of the record."""

    def __init__(
        self, store: Store, run_dir: str | Path, only: tuple[str, ...] | None = None, skip: tuple[str, ...] = ()
    ):
        self.store, self.run_dir, self.only, self.skip = store, Path(run_dir), only, (*NOT_RECORD, *skip)
        self.sent: dict[str, tuple[int, int]] = {}  # name → (mtime_ns, size) as last uploaded or downloaded
        self.lock = threading.Lock()  # the thread's syncs and the caller's never overlap
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.failing = False  # the last sync failed, and said so
        self.last = -math.inf  # when the last sync began: the first one due at once

    def _ours(self, name: str) -> bool:
        top = name.split("/", 1)[0]
        hidden = name.rsplit("/", 1)[-1].startswith(".")
        return not hidden and top not in self.skip and (self.only is None or top in self.only)

    def files(self) -> dict[str, tuple[int, int]]:
        """The record's files in the mirror now: name (relative, '/'-separated) → (mtime_ns, size)."""
        found = {}
        for folder, _, names in os.walk(self.run_dir):
            for n in names:
                path = Path(folder, n)
                name = path.relative_to(self.run_dir).as_posix()
                if self._ours(name):
                    with contextlib.suppress(FileNotFoundError):  # gone since the walk listed it
                        st = path.stat()
                        found[name] = (st.st_mtime_ns, st.st_size)
        return found

    def sync(self) -> list[str]:
        """Upload every record file that changed since its last upload; the names uploaded. StorageError
        (after the store's retries) leaves the rest for the next sync."""
        with self.lock:
            changed = {n: sig for n, sig in self.files().items() if self.sent.get(n) != sig}
            for name, sig in sorted(changed.items()):
                self.store.upload(self.run_dir, [name], "")
                self.sent[name] = sig  # as it was before the upload: a write during it is sent next time
            return sorted(changed)

    def pull(self) -> list[str]:
        """Download the store's record files that the mirror lacks (a fresh machine), and the store's
        summary.json when it records more invocations than the mirror's: the names downloaded."""
        with self.lock:
            self.run_dir.mkdir(parents=True, exist_ok=True)  # a node new to the run: its mirror starts here
            local = self.files()
            wanted = [n for n in self.store.listing() if self._ours(n) and (n not in local or n == SUMMARY)]
            if (
                SUMMARY in wanted
                and SUMMARY in local
                and _invocations(self.store.read_bytes(SUMMARY)) <= _invocations((self.run_dir / SUMMARY).read_bytes())
            ):
                wanted.remove(SUMMARY)
            self.store.download(wanted, "", self.run_dir)
            self.sent.update((n, sig) for n, sig in self.files().items() if n in wanted)
            return wanted

    def try_sync(self, on_error: Callable[[str], None]) -> None:
        """Sync; a failure is said (`on_error`, once until a sync succeeds again) and the caller goes on."""
        self.last = time.monotonic()
        try:
            self.sync()
            self.failing = False
        except StorageError as e:
            if not self.failing:
                on_error(f"the run record could not be uploaded (retried at the next sync): {e}")
            self.failing = True

    def try_pull(self, on_error: Callable[[str], None]) -> None:
        """Pull; a failure is said and the caller goes on with the mirror it has (rank 0 starting while the
        store is down: its metrics go on locally and are uploaded once it is back)."""
        try:
            self.pull()
        except StorageError as e:
            on_error(f"the run record could not be read from the store (going on with this node's copy): {e}")

    def start(self, interval_s: float, on_error: Callable[[str], None]) -> None:
        """Sync every `interval_s` on a thread of its own until `stop` (the driver)."""

        def loop() -> None:
            while not self.stopping.wait(interval_s):
                self.try_sync(on_error)

        self.thread = threading.Thread(target=loop, name="record-sync", daemon=True)
        self.thread.start()

    def sync_due(self, interval_s: float, on_error: Callable[[str], None]) -> None:
        """Sync on a thread if `interval_s` has passed since the last and none is under way: for a caller with
        a beat of its own (rank 0's metrics), whose step must not wait for the upload, and which may die with
        no thread of this left behind."""
        if time.monotonic() - self.last < interval_s or (self.thread is not None and self.thread.is_alive()):
            return
        self.last = time.monotonic()
        self.thread = threading.Thread(target=self.try_sync, args=(on_error,), name="record-sync", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """End the thread (a sync under way finishes first)."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join()


def _invocations(summary: bytes) -> int:
    try:
        return len(json.loads(summary).get("history", [])) + 1
    except ValueError:
        return 0


def record_sync(cfg: TrainConfig, run_dir: str | Path, only: tuple[str, ...] | None = None) -> RecordSync | None:
    """The RecordSync of the run's mirror `run_dir` to its URL, or None for a run on a plain directory."""
    return RecordSync(store_for(cfg.run_url, cfg.storage), run_dir, only) if cfg.run_url else None


@contextlib.contextmanager
def store_lock(store: Store, say: Callable[[str], None] = print) -> Iterator[None]:
    """The run's exclusive lock on the store: an object created by a conditional write (Store.create),
    naming its holder's host, PID and time; removed at the end, also on failure. A lock left by a dead process
    of this host is taken over; one held elsewhere must be removed by hand if stale (LockedError says how), as
    must one this process could not remove at its end (the store unreachable then: `say` says so)."""
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    if not store.conditional_writes():
        say(f"{store.url} ignores conditional writes: the run's lock is held once it reads back {SETTLE_S:g} s on")
    while not store.create(LOCK_OBJECT, json.dumps(me).encode()):
        try:
            holder = json.loads(store.read_bytes(LOCK_OBJECT))
        except FileNotFoundError:
            continue  # released between the two calls
        except ValueError:
            holder = {}
        if holder.get("host") == me["host"] and not alive(holder.get("pid", -1)):
            store.remove(LOCK_OBJECT)  # its holder died without cleaning up
            continue
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("since", 0)))
        raise LockedError(
            f"{store.url} is in use by pid {holder.get('pid')} on {holder.get('host')} since {since}; wait for that "
            f"run, or if it is no longer running delete its lock: {delete_command(f'{store.url}/{LOCK_OBJECT}')}"
        )
    try:
        yield
    finally:
        try:
            if json.loads(store.read_bytes(LOCK_OBJECT)) == me:  # never another's, should it have been taken over
                store.remove(LOCK_OBJECT)
        except FileNotFoundError:
            pass
        except StorageError as e:
            say(f"the run's lock could not be removed ({e}): delete {store.url}/{LOCK_OBJECT} before a rerun")
