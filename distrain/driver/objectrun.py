"""The driver's side of a run on an object store (run.storage=s3://…, any fsspec URL): the URL checked before
any worker starts, the run's lock on the store, and its record synced there while it trains and at its end
(storage/record_sync.py). Every process works in its local mirror (cfg.run_dir); the store holds the durable copy."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from distrain.config import ConfigError, TrainConfig
from distrain.storage.objectstore import StorageError, Store, quick_options, store_for
from distrain.storage.record_sync import RecordSync, store_lock
from distrain.storage.tracking import TRACKER_FILES

T = TypeVar("T")
STORE_POLL_S = 2.0  # while a restart waits for the store: the pause between looks (each with Store's own retries)


def check_run_url(cfg: TrainConfig) -> None:
    """One-line ConfigError unless run.storage's bucket exists (or storage.create_bucket makes it) and an object can
    be written, read back and deleted under the run's URL (with short timeouts: a wrong endpoint fails in seconds).
    After validation, which has checked the URL well-formed and its filesystem installed. A plan makes no bucket
    (and writes nothing to one it would make)."""
    try:
        store = Store(cfg.run_url, quick_options(cfg.run_url, cfg.storage.options), retries=0)
        if store.check_bucket(f"run.storage={cfg.run.storage!r}", cfg.storage.create_bucket, make=not cfg.plan):
            store.check_writable()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    except Exception as e:  # StorageError, or the filesystem's own before any try (an option it does not take)
        why = str(e) if isinstance(e, StorageError) else f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
        raise ConfigError(
            f"run.storage={cfg.run.storage!r}: cannot write the run at {cfg.run_url} ({why}); check the endpoint "
            f"(AWS_ENDPOINT_URL or +storage.options.endpoint_url), the bucket and the credentials in the environment"
        ) from None


@contextlib.contextmanager
def on_store(cfg: TrainConfig, run_dir: Path, say: Callable[[str], None]) -> Iterator[RecordSync | None]:
    """For a run on an object store: hold its lock there, fill a fresh mirror with its record (the history a
    rerun keeps), and sync the record every storage.sync_interval_s and once more at the end (summary.json
    written), also on failure; then release the lock. Nothing for a run on a plain directory."""
    if not cfg.run_url:
        yield None
        return
    store = store_for(cfg.run_url, cfg.storage)
    with contextlib.ExitStack() as held:
        held.enter_context(store_lock(store, say))
        record = RecordSync(store, run_dir, skip=TRACKER_FILES)  # the tracker uploads its own
        record.pull()
        record.start(cfg.storage.sync_interval_s, say)
        try:
            yield record
        finally:
            record.stop()
            try:
                record.sync()
            except StorageError as e:
                say(f"the run record could not be uploaded at the end, it is complete only in {run_dir}: {e}")


def patiently(cfg: TrainConfig, read: Callable[[], T], say: Callable[[str], None]) -> T:
    """read() (a restart's look at the run's store: its newest checkpoint), asked again while the store fails, for
    up to cluster.setup_timeout_s: an outage of the store, which cost only checkpoints while the run trained, does
    not end it at a restart. Said once when the wait begins; after it, StorageError in one line."""
    limit = cfg.cluster.setup_timeout_s
    deadline, said = time.monotonic() + limit, False
    while True:
        try:
            return read()
        except StorageError as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StorageError(
                    f"{cfg.run_url} did not answer within cluster.setup_timeout_s={limit:g} s of the restart ({e}); "
                    f"rerun the same command once the store is back: it resumes from the newest checkpoint there"
                ) from None
            if not said:
                say(f"the store does not answer ({e}); the restart waits for it (cluster.setup_timeout_s={limit:g})")
                said = True
            time.sleep(min(STORE_POLL_S, left))
