"""Checkpoints on an object store (run.storage=s3://…): the store holds the durable copy, each node's local
mirror the working one.

Every rank writes its files into its node's mirror exactly as on shared storage (saver.py), then, in the
Saver's background thread, uploads the files it wrote to `<url>/checkpoints/step_X/`. Rank 0 lists that
prefix on the store and only if every writer's file is there, at its size, writes `COMMITTED` (the
manifest: sizes and CRC-32s) there, last; then into each node's mirror. Objects have no rename and a
listing shows a half-written checkpoint as readily as a whole one: the marker written last is the commit.
A store that fails (after Store's retries) never ends the run: that checkpoint is not committed, rank 0
says so in one line, and the next checkpoint tries again. Retention runs on the store as in the mirror,
after a newer commit. Resuming needs only the URL: the newest checkpoint committed on the store is
downloaded into the node's mirror (once per node, under a file lock), verified there by its checksums
(checkpoint.problem) and loaded from there, restricted as always (safeload.py)."""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from distrain.storage import checkpoint, integrity
from distrain.storage.checkpoint import COMMIT_MARKER, META_FILE
from distrain.storage.fsutil import write_json
from distrain.storage.objectstore import StorageError, Store, store_for
from distrain.urls import mirror_dir

PREFIX = "checkpoints"
LOCK = ".download.lock"  # in a mirror's checkpoints directory: one download per node at a time


class Remote:
    """One rank's end of a run's checkpoints on the store (`store`: the run's URL). `after_upload(step)`
    runs after each object this rank uploads (fault.kill_mid_upload); `say` says rank 0's lines."""

    def __init__(
        self,
        store: Store,
        after_upload: Callable[[int], None] | None = None,
        say: Callable[[str], None] = checkpoint.say,
    ):
        self.store, self.after_upload, self.say = store, after_upload, say
        self.on_commit: Callable[[int], None] | None = None  # rank 0, after each commit (the run record's sync)
        self.upload_s: float | None = None  # rank 0: the last commit's slowest rank's upload seconds, until read

    def commit(self, path: Path, step: int, keep: int, group: Any = None) -> None:
        """Collective, after every rank's local write of `path` (the step's directory in the mirror): upload,
        commit on the store, then mark and prune each node's mirror. Never raises for the store."""
        import torch.distributed as dist

        rank, world, prefix = dist.get_rank(group), dist.get_world_size(group), f"{PREFIX}/{path.name}"
        (path / COMMIT_MARKER).unlink(missing_ok=True)  # a node's older save of this step is not this one
        error = failure_of(lambda: self.store.remove(prefix)) if rank == 0 else None  # a dead save's objects
        dist.barrier(group=group)
        written = {n: s for n, s in checkpoint.listing(path).items() if _writer(n) == rank}
        sums = integrity.checksums(path, written)
        start = time.perf_counter()
        if error is None:
            error = failure_of(lambda: self._upload(path, sorted(written), prefix, step))
        views: list[Any] = [None] * world
        dist.all_gather_object(views, (written, sums, error, time.perf_counter() - start), group=group)
        manifest = [self.commit_on_store(prefix, step, [v[:3] for v in views], keep) if rank == 0 else None]
        dist.broadcast_object_list(manifest, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        if manifest[0] is not None:
            write_json(path / COMMIT_MARKER, manifest[0])
            prune_mirror(path.parent, keep, step)
            if rank == 0:
                self.upload_s = max(v[3] for v in views)
                if self.on_commit is not None:
                    self.on_commit(step)

    def _upload(self, path: Path, names: list[str], prefix: str, step: int) -> None:
        for name in names:
            self.store.upload(path, [name], prefix)
            if self.after_upload is not None:
                self.after_upload(step)

    def commit_on_store(
        self, prefix: str, step: int, views: list, keep: int, writers: list[str] | None = None
    ) -> dict | None:
        """The committer (rank 0, or a parameter-server run's driver): the manifest written on the store once every
        writer's objects (`views`: per writer, what it wrote with sizes, their checksums, its upload's error or None)
        are there at their sizes, or None with one line saying why not. `writers`: their names, else rank 0, 1, …"""
        where = f"{self.store.url}/{prefix}"
        why = self._why_not(prefix, views, writers or [f"rank {r}" for r in range(len(views))])
        if isinstance(why, str):
            self.say(
                f"checkpoint of step {step} is not committed on {where}: {why}; training goes on, the next "
                f"checkpoint tries again"
            )
            return None
        error = failure_of(lambda: prune(self.store, keep, step))
        if error is not None:
            self.say(f"pruning {self.store.url}/{PREFIX} failed ({error}); the next commit tries again")
        return why

    def _why_not(self, prefix: str, views: list, writers: list[str]) -> dict | str:
        """The manifest, written on the store, or why it was not."""
        failed = [(r, e) for r, (_, _, e) in enumerate(views) if e]
        if failed:
            return f"{writers[failed[0][0]]}: {failed[0][1]}"
        sums = {name: crc for _, s, _ in views for name, crc in s.items()}
        try:
            found = self.store.listing(prefix)
        except StorageError as e:
            return str(e)
        for r, (written, _, _) in enumerate(views):
            for name, size in written.items():
                if found.get(name) != size:
                    seen = "no such object" if name not in found else f"{found[name]} bytes"
                    return f"{writers[r]} uploaded {name} ({size} bytes), the store has {seen}"
        if set(found) != set(sums):
            return f"objects no rank wrote: {sorted(set(found) - set(sums))[:3]}"
        step = checkpoint.step_of(checkpoint.name_of(prefix))
        manifest = {"step": step, "files": found, "crc32": {name: sums[name] for name in found}}
        error = failure_of(lambda: self.store.write_bytes(f"{prefix}/{COMMIT_MARKER}", _json(manifest)))
        return manifest if error is None else error


def prune_mirror(root: Path, keep: int, step: int) -> None:
    """Prune a node's mirror after the commit of `step`: a node holds its own ranks' files of each step (the store
    holds them all), so a step it marked committed counts as kept, not only one whose every file is there (which
    on a node without rank 0's files none is: nothing was ever pruned there)."""
    checkpoint.prune(root, keep, step, whole=lambda path: (path / COMMIT_MARKER).exists())


def _json(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()  # as the mirror's (fsutil.write_json)


def _writer(name: str) -> int:
    """The rank that uploads a file: its writer where the name says it, else rank 0 (.metadata, meta.json)."""
    writer = checkpoint.writer_of(name)
    return 0 if writer is None else writer


def failure_of(fn: Callable[[], Any]) -> str | None:
    """fn()'s StorageError as its line, or None: what a writer reports instead of raising."""
    try:
        fn()
    except StorageError as e:
        return str(e)
    return None


# -- what is on the store ------------------------------------------------------------------------------


def on_store(store: Store) -> dict[str, dict[str, int]]:
    """Every step directory on the store, newest first: its name → its objects (name → size)."""
    found: dict[str, dict[str, int]] = {}
    for name, size in store.listing(PREFIX).items():
        step, _, rest = name.partition("/")
        if checkpoint.is_step_dir(step) and rest and "/" not in rest:
            found.setdefault(step, {})[rest] = size
    return dict(sorted(found.items(), reverse=True))


def problem_on_store(store: Store, name: str, objects: dict[str, int]) -> str | None:
    """Why the step directory `name` on the store must not be loaded, judged by its marker and the sizes it
    records (its checksums are checked once downloaded), or None."""
    if COMMIT_MARKER not in objects:
        return "no commit marker (its save never finished)"
    try:
        files = json.loads(store.read_bytes(f"{PREFIX}/{name}/{COMMIT_MARKER}"))["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable commit marker ({e})"
    for file, size in files.items():
        if file not in objects:
            return f"{file} is missing"
        if objects[file] != size:
            return f"{file} is {objects[file]} bytes, the commit recorded {size} (truncated or damaged)"
    return None


def prune(store: Store, keep: int, committed: int) -> None:
    """checkpoint.prune on the store: committed checkpoints beyond the newest `keep` and torn ones older than
    those kept are deleted, counting from the one just `committed`; a torn one never takes a keep slot."""
    kept = 0
    for name, objects in on_store(store).items():
        if checkpoint.step_of(name) > committed:
            continue
        if kept < keep:
            kept += problem_on_store(store, name, objects) is None
            continue
        store.remove(f"{PREFIX}/{name}")


def latest_meta(store: Store) -> tuple[str, dict] | None:
    """The newest checkpoint committed on the store (by its marker and sizes) and its meta.json, read from
    the store: what the driver decides a resume with, nothing downloaded. Lines and errors as
    checkpoint.latest's."""
    found = on_store(store)
    metas: dict[str, dict] = {}

    def check(name: str) -> tuple[str | None, bool]:
        why = problem_on_store(store, name, found[name])
        if why is None:
            try:
                metas[name] = json.loads(store.read_bytes(f"{PREFIX}/{name}/{META_FILE}"))
            except (ValueError, FileNotFoundError) as e:
                why = f"{META_FILE} is unreadable ({e})"
        return why, COMMIT_MARKER in found[name]

    url = checkpoint.newest_whole(f"{store.url}/{PREFIX}", _candidates(store, found, check))
    return None if url is None else (checkpoint.name_of(url), metas[checkpoint.name_of(url)])


def fetch(store: Store, mirror: Path, newest: int | None = None, only: bool = False) -> Path | None:
    """The newest checkpoint committed on the store (at or before step `newest`; with `only`, that step's
    alone) downloaded into `mirror` (a node's checkpoints directory) and verified there by its checksums;
    None when there is no committed one. DamagedCheckpointError as checkpoint.latest."""
    found = {n: o for n, o in on_store(store).items() if newest is None or _picked(n, newest, only)}

    def check(name: str) -> tuple[str | None, bool]:
        why = problem_on_store(store, name, found[name])
        if why is None:
            why = checkpoint.problem(download(store, name, mirror))
        return why, COMMIT_MARKER in found[name]

    url = checkpoint.newest_whole(f"{store.url}/{PREFIX}", _candidates(store, found, check))
    return None if url is None else mirror / checkpoint.name_of(url)


def _picked(name: str, newest: int, only: bool) -> bool:
    step = checkpoint.step_of(name)
    return step == newest if only else step <= newest


def _candidates(store: Store, found: dict, check: Callable[[str], tuple[str | None, bool]]) -> Iterator:
    return ((f"{store.url}/{PREFIX}/{name}", lambda n=name: check(n)) for name in found)


def download(store: Store, name: str, mirror: Path) -> Path:
    """The committed checkpoint `name` copied from the store into `mirror`, once per node: ranks sharing the
    mirror take turns (a file lock), and a file already there at its size and checksum is kept. The marker
    is written last, as on the store."""
    mirror.mkdir(parents=True, exist_ok=True)
    path = mirror / name
    with open(mirror / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = json.loads(store.read_bytes(f"{PREFIX}/{name}/{COMMIT_MARKER}"))
        path.mkdir(exist_ok=True)
        sizes, sums = manifest["files"], manifest["crc32"]
        present = [n for n, s in sizes.items() if (path / n).is_file() and (path / n).stat().st_size == s]
        kept = {n for n, crc in integrity.checksums(path, present).items() if crc == sums[n]}
        missing = [n for n in sizes if n not in kept]
        if missing:
            (path / COMMIT_MARKER).unlink(missing_ok=True)
            store.download(missing, f"{PREFIX}/{name}", path)
        write_json(path / COMMIT_MARKER, manifest)
    return path


def mirror_of(url: str, storage: Any) -> tuple[Store, Path]:
    """The run at `url`'s Store (with the `storage` config) and this node's mirror of its checkpoints."""
    return store_for(url, storage), mirror_dir(url, storage.cache_dir) / PREFIX
