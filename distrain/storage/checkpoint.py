"""Distributed checkpoints with an atomic commit.

Every rank writes its DCP shard and a small file of its own state (RNG); rank 0 writes the run's
metadata. Then every rank sends rank 0 the files it sees; only when rank 0 sees all of them, at the
same sizes, does it write `COMMITTED`, a manifest of every file with its size and checksum (each rank
checksums the files it wrote: integrity.py). A `Saver` does this in the background: the step waits only
while the state is copied into host memory, DCP's `async_save` writes the copy from a thread, and the commit
follows once every rank's write has finished. A directory without a valid manifest, with a file whose size
or checksum differs from it, or with an unreadable meta.json, is never loaded: the newest one that verifies
is, with one line for each one skipped; when committed ones exist and none verifies, nothing is loaded and
nothing deleted (DamagedCheckpointError). Old checkpoints are deleted only after a newer one has committed.

The run directory is shared storage that other people and jobs can write, so nothing in it is
unpickled beyond tensors and plain data: a pickled callable would run in every rank that resumes.
A file that holds more is refused whole (UnsafeCheckpointError), never partly loaded.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import io
import json
import pickle
import re
import shutil
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PosixPath
from typing import IO, Any

from distrain.storage import integrity
from distrain.storage.fsutil import atomic_write, write_json

COMMIT_MARKER = "COMMITTED"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_WRITER = re.compile(r"^(?:__|rank_)(\d+)[_.]")  # DCP's __<rank>_<n>.distcp, our rank_<rank>.pt
_said: set[str] = set()  # the lines `latest` has said in this process


class CheckpointNotSharedError(RuntimeError):
    """A rank's checkpoint files are not visible to rank 0: the run's storage is not shared."""


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds more than tensors and plain data (a pickled callable or class): loading
    it could run code someone planted in the run's storage, so it is refused. Retrying cannot help."""

    permanent = True  # read by the supervisor: the run ends at once, with this error's one line


class DamagedCheckpointError(RuntimeError):
    """Committed checkpoints exist but none can be loaded as it was saved (or a file is not what a save
    writes). Retrying cannot help; nothing is deleted, so a copy can be restored or the damaged one moved."""

    permanent = True  # read by the supervisor: the run ends at once, with this error's one line


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def save(root: str | Path, step: int, state: dict[str, Any], meta: dict, rank_state: dict, keep: int) -> Path:
    """Collective: every rank calls it with its own shard of `state` and its own `rank_state`; returns once
    the checkpoint has committed."""
    return Saver(root, keep).save(step, state, meta, rank_state)


class Saver:
    """One rank's end of a run's checkpoints: every rank calls `save` at the same step.

    In the `background` (checkpoint.async), `save` returns once the state is copied into host memory
    (pinned when it is on a GPU, so the copy runs at full speed; the copies are reused from save to save);
    DCP's `async_save` writes the copy from a thread while training goes on, and a second thread commits
    once every rank's write has finished: a torn save is as unloadable as in the foreground. One save is in
    flight at a time: the next one, and `wait`, wait for it. The writes' collectives run on a gloo group of
    their own, so they never queue behind, or hold up, the training's."""

    def __init__(
        self, root: str | Path, keep: int, background: bool = False, pin: bool = False, timeout_s: float = 600.0
    ):
        import torch.distributed as dist

        from distrain.compat import checkpoint_stager

        self.root, self.keep, self.background = Path(root), keep, background
        self.group, self.stager = None, None
        if background:
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            self.stager = checkpoint_stager(pin)
        self.committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
        self.pending: Future | None = None
        self.last_save_s = 0.0  # the last save's seconds from its start to its commit

    def save(self, step: int, state: dict[str, Any], meta: dict, rank_state: dict) -> Path:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.wait()
        refuse_unplain(state, f"the state of step {step}")
        start, rank = time.perf_counter(), dist.get_rank()
        path = step_dir(self.root, step)
        if rank == 0:
            prepare(self.root, step)
        dist.barrier(group=self.group)
        buf = io.BytesIO()
        torch.save(rank_state, buf)
        atomic_write(path / _rank_file(rank), buf.getvalue())
        if rank == 0:
            write_json(path / META_FILE, meta)
        if not self.background:
            dcp.save(state, checkpoint_id=str(path), process_group=self.group)
            self._commit(path, step, None, start)
            return path
        upload = dcp.async_save(state, checkpoint_id=str(path), process_group=self.group, async_stager=self.stager)
        self.pending = self.committer.submit(self._commit, path, step, upload, start)
        return path

    def _commit(self, path: Path, step: int, upload: Future | None, start: float) -> None:
        import torch.distributed as dist

        if upload is not None:
            upload.result()
        # Every rank's DCP save returns after the coordinator wrote `.metadata`, once every rank's data was
        # written; the rank files and meta.json were written before: the listings are now comparable. Each
        # rank checksums the files it wrote (rank 0 the shared ones), still in its page cache.
        rank, world, listing = dist.get_rank(self.group), dist.get_world_size(self.group), _listing(path)
        sums = integrity.checksums(path, [name for name in listing if _hasher(name, world) == rank])
        views: list[tuple[dict[str, int], dict[str, int]]] = [({}, {})] * world
        dist.all_gather_object(views, (listing, sums), group=self.group)
        if rank == 0:
            writers = {f"rank {r}": view for r, (view, _) in enumerate(views)}
            commit(self.root, step, writers, self.keep, "rank 0", {k: v for _, s in views for k, v in s.items()})
        self.last_save_s = time.perf_counter() - start

    def wait(self) -> None:
        """Until the save in flight has committed; raises its error if it failed."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def check(self) -> None:
        """Raise a background save's error as soon as it has one, without waiting for a save in flight."""
        if self.pending is not None and self.pending.done():
            self.wait()

    def close(self) -> None:
        self.wait()
        self.committer.shutdown()
        if self.stager is not None:
            self.stager.close()


PLAIN = (bool, int, float, str, bytes, type(None))


def unplain_leaves(state: Any, allowed: Sequence[type] = (), at: str = "") -> list[str]:
    """Where `state` holds something other than tensors, plain data in dicts, lists and tuples, and
    instances of `allowed`: each such leaf's key path and type. Staging deep-copies whatever it finds,
    and a resume's safe loader refuses it, so it must never reach a checkpoint."""
    import torch

    if isinstance(state, dict):
        return [bad for k, v in state.items() for bad in unplain_leaves(v, allowed, f"{at}.{k}" if at else str(k))]
    if isinstance(state, (list, tuple)):
        return [bad for i, v in enumerate(state) for bad in unplain_leaves(v, allowed, f"{at}[{i}]")]
    if isinstance(state, (torch.Tensor, *PLAIN, *allowed)):
        return []
    return [f"{at or 'the state'} ({type(state).__qualname__})"]


def refuse_unplain(state: Any, what: str, allowed: Sequence[type] = ()) -> None:
    """TypeError, before anything is written, if `state` holds more than tensors and plain data."""
    bad = unplain_leaves(state, allowed)
    if bad:
        raise TypeError(
            f"{what} holds {', '.join(bad[:3])}{' and more' if len(bad) > 3 else ''}: a checkpoint holds only "
            f"tensors and plain data; nothing was written"
        )


def _hasher(name: str, world: int) -> int:
    """The rank that checksums a file at commit: its writer where the name says it, else rank 0. Which
    rank does is only a matter of spreading the reads; any rank's checksum of a file is the same."""
    writer = _WRITER.match(name)
    return int(writer[1]) % world if writer else 0


def commit(
    root: str | Path,
    step: int,
    views: dict[str, dict[str, int]],
    keep: int,
    reader: str,
    sums: dict[str, int] | None = None,
) -> None:
    """Mark a checkpoint loadable once `reader` (the committer) sees every file each writer wrote
    (`views`: writer → file → size), at its size; then prune older ones. The manifest records each file's
    checksum: from `sums` (file → checksum, the writers') or read here."""
    path = step_dir(root, step)
    files = _listing(path)
    for writer, view in views.items():
        for name, size in view.items():
            if files.get(name) != size:
                raise CheckpointNotSharedError(
                    f"{writer} wrote {path / name} ({size} bytes) but {reader} sees "
                    f"{'no such file' if name not in files else f'{files[name]} bytes'}: run.storage must "
                    f"be storage every node shares; the checkpoint is left uncommitted"
                )
    sums = dict(sums or {})
    sums |= integrity.checksums(path, [name for name in files if name not in sums])
    write_json(path / COMMIT_MARKER, {"step": step, "files": files, "crc32": {name: sums[name] for name in files}})
    prune(root, keep, step)


def prepare(root: str | Path, step: int) -> Path:
    """An empty directory for the checkpoint of `step`: one left by a save that died before
    committing is never loadable, so it is safe to replace."""
    path = step_dir(root, step)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _listing(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.name != COMMIT_MARKER}


def problem(path: Path, verify: bool = True) -> str | None:
    """Why this checkpoint must not be loaded, or None if it is whole: a commit marker, every file it lists
    at its size; with `verify`, at its checksum too (reading every file, once per process while the files
    are unchanged) and meta.json readable. A checkpoint committed before checksums were recorded is checked
    by its sizes only."""
    marker = path / COMMIT_MARKER
    if not marker.exists():
        return "no commit marker (its save never finished)"
    try:
        manifest = json.loads(marker.read_text())
        files, sums = manifest["files"], manifest.get("crc32", {})
        if sums and set(sums) != set(files):
            raise ValueError("its checksums do not cover its files")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable commit marker ({e})"
    for name, size in files.items():
        f = path / name
        if not f.exists():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} is {f.stat().st_size} bytes, the commit recorded {size} (truncated or damaged)"
    if not verify:
        return None
    damage = integrity.mismatch(path, sums) if sums else None
    if damage:
        return damage
    try:
        if not isinstance(read_meta(path).get("step"), int):
            raise ValueError("no step in it")
    except (OSError, ValueError, AttributeError) as e:
        return f"{META_FILE} is unreadable ({e})"
    return None


def checkpoints(root: str | Path) -> list[Path]:
    """Every step directory, newest first, committed or not."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def latest(root: str | Path) -> Path | None:
    """The newest checkpoint that verifies (`problem`), or None when there is no committed one. Each newer
    one skipped is said in one line on stderr, once per process: a run looks again at every restart.
    DamagedCheckpointError, in one line, when committed ones exist and none verifies."""
    skipped = []
    for path in checkpoints(root):
        why = problem(path)
        if why is None:
            for p, w in skipped:
                _say_once(f"skipping checkpoint {p}: {w}; loading {path.name}, the newest that verifies")
            return path
        skipped.append((path, why))
    damaged = [(p, w) for p, w in skipped if (p / COMMIT_MARKER).exists()]
    if damaged:
        listed = "; ".join(f"{p.name}: {w}" for p, w in damaged[:3]) + ("; …" if len(damaged) > 3 else "")
        raise DamagedCheckpointError(
            f"no checkpoint in {root} verifies ({listed}); nothing was deleted: restore them from a copy, or "
            f"move them out of {root} to train from scratch"
        )
    for p, w in skipped:
        _say_once(f"skipping checkpoint {p}: {w}")
    return None


def _say_once(line: str) -> None:
    if line not in _said:
        _said.add(line)
        print(f"distrain: {line}", file=sys.stderr, flush=True)


def prune(root: str | Path, keep: int, committed: int | None = None) -> None:
    """Delete committed checkpoints beyond the newest `keep`, and torn ones older than those kept, counting
    from the one just `committed`: newer ones (damaged, the run resumed from an older one) are left alone
    until the run saves their step again. Judged by sizes: a commit does not read every checkpoint again."""
    kept = 0
    for path in checkpoints(root):
        if committed is not None and int(path.name.removeprefix("step_")) > committed:
            continue
        if kept < keep:
            kept += problem(path, verify=False) is None
            continue
        shutil.rmtree(path, ignore_errors=True)


def read_meta(path: str | Path) -> dict:
    """The run's metadata of a checkpoint (step, world size, data position, config, W&B id)."""
    return json.loads((Path(path) / META_FILE).read_text())


def load(path: str | Path, state: dict[str, Any]) -> tuple[dict, dict | None]:
    """Fill `state` in place from the checkpoint; return its metadata and this rank's own state
    (None when the checkpoint was written by a different number of ranks). UnsafeCheckpointError
    if a file it reads holds more than tensors and plain data."""
    import torch.distributed as dist

    path = Path(path)
    read_state(path, state)
    meta = read_meta(path)
    rank_file = path / _rank_file(dist.get_rank())
    rank_state = None
    if meta.get("world_size") == dist.get_world_size() and rank_file.exists():
        rank_state = load_tensors(rank_file)
    return meta, rank_state


def read_state(path: str | Path, state: dict[str, Any], no_dist: bool = False) -> None:
    """Fill `state` in place from the checkpoint's tensors, whatever layout wrote them (`no_dist`: in one
    process without a process group). UnsafeCheckpointError if a file holds more than tensors and plain data."""
    import torch.distributed.checkpoint as dcp

    path, refusals = Path(path), []
    reader, planner = _guarded_reader(path, refusals), _guarded_planner(path, refusals)
    try:
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    except (Exception, dcp.CheckpointException):  # the latter is a BaseException
        if refusals:  # DCP wraps what its reader and planner raise: the refusal itself is the error
            raise refusals[0] from None
        raise


def load_tensors(path: str | Path, allowed: Sequence[type] = ()) -> Any:
    """A torch.save file of tensors and plain data, and instances of the `allowed` classes (plain
    records only: loading one calls its constructor); anything else is refused, never run."""
    return _weights_only(path, str(path), allowed)


def _weights_only(f: str | Path | IO[bytes], where: str, allowed: Sequence[type] = ()) -> Any:
    import torch

    with torch.serialization.safe_globals(list(allowed)):
        try:
            return torch.load(f, weights_only=True)
        except pickle.UnpicklingError:
            if not isinstance(f, (str, Path)):
                f.seek(0)
            try:
                names = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(f))
            except (ValueError, RuntimeError):  # not torch.save's zip format: nothing to list
                names = ""
                if not _is_pickle(f):
                    raise DamagedCheckpointError(
                        f"{where} is damaged: it is neither a file torch.save wrote nor a pickle; move its "
                        f"checkpoint directory out of the way to resume from the one before"
                    ) from None
            raise UnsafeCheckpointError(_refusal(where, names or "pickled data torch's safe loader rejects")) from None


def _is_pickle(f: str | Path | IO[bytes]) -> bool:
    """Whether the bytes parse as a pickle (never running it): random bytes do not, a planted pickle does."""
    import pickletools

    with open(f, "rb") if isinstance(f, (str, Path)) else contextlib.nullcontext(f) as stream:
        stream.seek(0)
        try:
            for _ in pickletools.genops(stream):
                pass
        except Exception:  # whatever a malformed opcode stream raises
            return False
    return True


def _refusal(where: str, what: str) -> str:
    return (
        f"refused to load {where}: it holds {what}, not only tensors and plain data, and could run code; "
        f"delete its checkpoint directory or resume from another checkpoint"
    )


@functools.cache
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """What DCP's `.metadata` pickle is made of, by (module, name): DCP's own records, torch.Size,
    dtypes and layouts, and the path it was saved to."""
    import torch
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint import metadata as md

    records = (
        md.Metadata,
        md.MetadataIndex,
        md.StorageMeta,
        md.TensorProperties,
        md.TensorStorageMetadata,
        md.BytesStorageMetadata,
        md.ChunkStorageMetadata,
        md._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,
        torch.Size,
        torch.serialization._get_layout,  # a lookup among torch's layouts
        PosixPath,
    )
    dtypes = {("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
    return {(r.__module__, r.__qualname__): r for r in records} | dtypes


class _Unlisted(pickle.UnpicklingError):
    """A pickle names a global outside the allowed ones; the message is its name."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata`, a plain pickle, with nothing but _metadata_globals."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _metadata_globals()[module, name]
        except KeyError:
            raise _Unlisted(f"{module}.{name}") from None


def _guarded_reader(path: Path, refusals: list[UnsafeCheckpointError]) -> Any:
    """DCP's file reader for `path`, whose `.metadata` is unpickled by _MetadataUnpickler; a refusal
    is also kept in `refusals`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class GuardedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            file = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(file, "rb") as f:
                try:
                    metadata = _MetadataUnpickler(f).load()
                except _Unlisted as e:
                    refusals.append(UnsafeCheckpointError(_refusal(str(file), str(e))))
                    raise refusals[-1] from None
            if getattr(metadata, "storage_meta", None) is None:  # as DCP's own reader does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return GuardedReader(path)


def _guarded_planner(path: Path, refusals: list[UnsafeCheckpointError]) -> Any:
    """DCP's load planner, but an item that is not a tensor (DCP torch.loads those with
    weights_only=False) must be tensors and plain data; a refusal is also kept in `refusals`."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class GuardedPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                _weights_only(value, f"item {read_item.dest_index.fqn} of {path}")
            except UnsafeCheckpointError as e:
                refusals.append(e)
                raise
            value.seek(0)  # checked: DCP's own load of the same bytes now builds only what passed
            super().load_bytes(read_item, value)

    return GuardedPlanner()
