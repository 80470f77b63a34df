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
What is read back is tensors and plain data only (safeload.py).
"""

from __future__ import annotations

import datetime
import io
import json
import re
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from distrain.storage import integrity
from distrain.storage.fsutil import atomic_write, write_json
from distrain.storage.safeload import DamagedCheckpointError, load_tensors, read_state, refuse_unplain

COMMIT_MARKER = "COMMITTED"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_WRITER = re.compile(r"^(?:__|rank_)(\d+)[_.]")  # DCP's __<rank>_<n>.distcp, our rank_<rank>.pt
_said: set[str] = set()  # the lines `latest` has said in this process


class CheckpointNotSharedError(RuntimeError):
    """A rank's checkpoint files are not visible to rank 0: the run's storage is not shared."""


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
        _say_once(f"skipping checkpoint {p}: {w}; no older checkpoint, so nothing is loaded (a run starts at step 0)")
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
