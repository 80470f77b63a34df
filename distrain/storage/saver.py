"""One rank's end of a run's checkpoints (checkpoint.py has their format, commit and loading): a save in
the foreground, or in the background while training goes on; with an object store, the upload and the
commit there follow the local write (remote.py)."""

from __future__ import annotations

import datetime
import io
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from distrain.storage import checkpoint, integrity
from distrain.storage.fsutil import atomic_write
from distrain.storage.safeload import refuse_unplain


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
        self,
        root: str | Path,
        keep: int,
        background: bool = False,
        pin: bool = False,
        timeout_s: float = 600.0,
        remote: Any = None,
    ):
        import torch.distributed as dist

        from distrain.compat import checkpoint_stager

        self.root, self.keep, self.background = Path(root), keep, background
        self.remote = remote  # remote.Remote: the durable copy is on an object store, `root` a node's mirror
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
        path = checkpoint.step_dir(self.root, step)
        if rank == 0:
            checkpoint.prepare(self.root, step)
        dist.barrier(group=self.group)
        path.mkdir(parents=True, exist_ok=True)  # a node's own mirror, with an object store
        buf = io.BytesIO()
        torch.save(rank_state, buf)
        atomic_write(path / checkpoint.rank_file(rank), buf.getvalue())
        if rank == 0:
            checkpoint.write_meta(path, meta)
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
        if self.remote is not None:  # uploaded, then committed on the store (remote.py)
            self.remote.commit(path, step, self.keep, self.group)
            self.last_save_s = time.perf_counter() - start
            return
        # Every rank's DCP save returns after the coordinator wrote `.metadata`, once every rank's data was
        # written; the rank files and meta.json were written before: the listings are now comparable. Each
        # rank checksums the files it wrote (rank 0 the shared ones), still in its page cache.
        rank, world, listing = dist.get_rank(self.group), dist.get_world_size(self.group), checkpoint.listing(path)
        sums = integrity.checksums(path, [name for name in listing if _hasher(name, world) == rank])
        views: list[tuple[dict[str, int], dict[str, int]]] = [({}, {})] * world
        dist.all_gather_object(views, (listing, sums), group=self.group)
        if rank == 0:
            writers = {f"rank {r}": view for r, (view, _) in enumerate(views)}
            sums = {k: v for _, s in views for k, v in s.items()}
            checkpoint.commit(self.root, step, writers, self.keep, "rank 0", sums)
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
    writer = checkpoint.writer_of(name)
    return writer % world if writer is not None else 0
