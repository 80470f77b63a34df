"""Distributed checkpoints with an atomic commit.

Every rank writes its DCP shard and a small file of its own state (RNG); rank 0 writes the run's
metadata. Then every rank sends rank 0 the files it sees; only when rank 0 sees all of them, at the
same sizes, does it write `COMMITTED`, a manifest of every file with its size. A directory without
a valid manifest, or with a file whose size differs from it (a truncated shard), is never loaded:
the newest valid one is, with a warning for each one skipped. Old checkpoints are deleted only
after a newer one has committed.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from distrain.fsutil import atomic_write, write_json

COMMIT_MARKER = "COMMITTED"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointNotSharedError(RuntimeError):
    """A rank's checkpoint files are not visible to rank 0: the run's storage is not shared."""


class TornCheckpointWarning(UserWarning):
    """A checkpoint directory was skipped because its save never completed or a file was damaged."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def save(root: str | Path, step: int, state: dict[str, Any], meta: dict, rank_state: dict, keep: int) -> Path:
    """Collective: every rank calls it with its own shard of `state` and its own `rank_state`."""
    import torch  # here, not at the top: the driver finds and commits checkpoints without torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    path = step_dir(root, step)
    if rank == 0:
        prepare(root, step)
    dist.barrier()
    dcp.save(state, checkpoint_id=str(path))
    buf = io.BytesIO()
    torch.save(rank_state, buf)
    atomic_write(path / _rank_file(rank), buf.getvalue())
    if rank == 0:
        write_json(path / META_FILE, meta)
    dist.barrier()  # every rank has finished writing; only now are the listings comparable
    views: list[dict[str, int]] = [{}] * dist.get_world_size()
    dist.all_gather_object(views, _listing(path))
    if rank == 0:
        commit(root, step, {f"rank {r}": view for r, view in enumerate(views)}, keep, reader="rank 0")
    return path


def commit(root: str | Path, step: int, views: dict[str, dict[str, int]], keep: int, reader: str) -> None:
    """Mark a checkpoint loadable once `reader` (the committer) sees every file each writer wrote
    (`views`: writer → file → size), at its size; then prune older ones."""
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
    write_json(path / COMMIT_MARKER, {"step": step, "files": files})
    prune(root, keep)


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


def _problem(path: Path) -> str | None:
    """Why this checkpoint must not be loaded, or None if it is whole."""
    marker = path / COMMIT_MARKER
    if not marker.exists():
        return "no commit marker (its save never finished)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable commit marker ({e})"
    for name, size in files.items():
        f = path / name
        if not f.exists():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} is {f.stat().st_size} bytes, the commit recorded {size} (truncated or damaged)"
    return None


def checkpoints(root: str | Path) -> list[Path]:
    """Every step directory, newest first, committed or not."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def latest(root: str | Path) -> Path | None:
    """The newest committed, intact checkpoint; warns about each newer one it has to skip."""
    for path in checkpoints(root):
        problem = _problem(path)
        if problem is None:
            return path
        warnings.warn(f"skipping checkpoint {path}: {problem}", TornCheckpointWarning, stacklevel=2)
    return None


def prune(root: str | Path, keep: int) -> None:
    """Delete committed checkpoints beyond the newest `keep`, and torn ones older than those kept."""
    kept = 0
    for path in checkpoints(root):
        if kept < keep:
            kept += _problem(path) is None
            continue
        shutil.rmtree(path, ignore_errors=True)


def read_meta(path: str | Path) -> dict:
    """The run's metadata of a checkpoint (step, world size, data position, config, W&B id)."""
    return json.loads((Path(path) / META_FILE).read_text())


def load(path: str | Path, state: dict[str, Any]) -> tuple[dict, dict | None]:
    """Fill `state` in place from the checkpoint; return its metadata and this rank's own state
    (None when the checkpoint was written by a different number of ranks)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    dcp.load(state, checkpoint_id=str(path))
    meta = read_meta(path)
    rank_file = path / _rank_file(dist.get_rank())
    rank_state = None
    if meta.get("world_size") == dist.get_world_size() and rank_file.exists():
        rank_state = torch.load(rank_file, weights_only=False)
    return meta, rank_state
