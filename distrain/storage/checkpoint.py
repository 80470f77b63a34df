"""Distributed checkpoints with an atomic commit.

Every rank writes its DCP shard and a small file of its own state (RNG); rank 0 writes the run's
metadata. Then every rank sends rank 0 the files it sees; only when rank 0 sees all of them, at the
same sizes, does it write `COMMITTED`, a manifest of every file with its size and checksum (each rank
checksums the files it wrote: integrity.py). A `Saver` (saver.py) does this in the background: the step waits only
while the state is copied into host memory, DCP's `async_save` writes the copy from a thread, and the commit
follows once every rank's write has finished. A directory without a valid manifest, with a file whose size
or checksum differs from it, or with an unreadable meta.json, is never loaded: the newest one that verifies
is, with one line for each one skipped; when committed ones exist and none verifies, nothing is loaded and
nothing deleted (DamagedCheckpointError). Old checkpoints are deleted only after a newer one has committed.
What is read back is tensors and plain data only (safeload.py).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from distrain.storage import integrity
from distrain.storage.fsutil import write_json
from distrain.storage.safeload import DamagedCheckpointError, load_tensors, read_state

COMMIT_MARKER = "COMMITTED"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_WRITER = re.compile(r"^(?:__|rank_)(\d+)[_.]")  # DCP's __<rank>_<n>.distcp, our rank_<rank>.pt
_said: set[str] = set()  # the lines `latest` has said in this process


def writer_of(name: str) -> int | None:
    """The rank that wrote a checkpoint file, where its name says it; None for the run's shared files."""
    writer = _WRITER.match(name)
    return int(writer[1]) if writer else None


class CheckpointNotSharedError(RuntimeError):
    """A rank's checkpoint files are not visible to rank 0: the run's storage is not shared."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


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
    files = listing(path)
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


def listing(path: Path) -> dict[str, int]:
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
    """The newest checkpoint that verifies (`problem`), or None when there is no committed one (`newest_whole`)."""
    checks = ((str(p), lambda p=p: (problem(p), (p / COMMIT_MARKER).exists())) for p in checkpoints(root))
    found = newest_whole(str(root), checks)
    return found and Path(found)


def newest_whole(where: str, candidates: Iterable[tuple[str, Callable[[], tuple[str | None, bool]]]]) -> str | None:
    """The first of `candidates` (newest first: a checkpoint's path or URL, and its check: why it must not be
    loaded or None, and whether it has a commit marker) that is whole, checked one by one; None when there
    is no committed one. Each newer one skipped is said in one line on stderr, once per process: a run
    looks again at every restart. DamagedCheckpointError, in one line, when committed ones exist and none
    verifies."""
    skipped = []
    for where_one, check in candidates:
        why, marked = check()
        if why is None:
            for p, w, _ in skipped:
                _say_once(f"skipping checkpoint {p}: {w}; loading {name_of(where_one)}, the newest that verifies")
            return where_one
        skipped.append((where_one, why, marked))
    damaged = [(p, w) for p, w, marked in skipped if marked]
    if damaged:
        listed = "; ".join(f"{name_of(p)}: {w}" for p, w in damaged[:3]) + ("; …" if len(damaged) > 3 else "")
        raise DamagedCheckpointError(
            f"no checkpoint in {where} verifies ({listed}); nothing was deleted: restore them from a copy, or "
            f"move them out of {where} to train from scratch"
        )
    for p, w, _ in skipped:
        _say_once(f"skipping checkpoint {p}: {w}; no older checkpoint, so nothing is loaded (a run starts at step 0)")
    return None


def name_of(where: str) -> str:
    """A checkpoint's directory name (step_XXXXXXXX) from its path or URL."""
    return where.rstrip("/").rsplit("/", 1)[-1]


def is_step_dir(name: str) -> bool:
    return bool(_STEP_DIR.match(name))


def step_of(name: str) -> int:
    return int(name.removeprefix("step_"))


def _say_once(line: str) -> None:
    if line not in _said:
        _said.add(line)
        say(line)


def say(line: str) -> None:
    """One line on stderr, where a rank's and the driver's lines are read."""
    print(f"distrain: {line}", file=sys.stderr, flush=True)


def prune(
    root: str | Path, keep: int, committed: int | None = None, whole: Callable[[Path], bool] | None = None
) -> None:
    """Delete committed checkpoints beyond the newest `keep`, and torn ones older than those kept, counting
    from the one just `committed`: newer ones (damaged, the run resumed from an older one) are left alone
    until the run saves their step again. Judged by sizes: a commit does not read every checkpoint again.
    `whole`: what counts as a committed checkpoint there (a node's mirror of a store's: remote.py)."""
    kept = 0
    for path in checkpoints(root):
        if committed is not None and step_of(path.name) > committed:
            continue
        if kept < keep:
            kept += whole(path) if whole is not None else problem(path, verify=False) is None
            continue
        shutil.rmtree(path, ignore_errors=True)


def write_meta(path: str | Path, meta: dict) -> int:
    """A checkpoint's meta.json, with the distrain version that wrote it (what a later release reading it may need
    to know); its size in bytes."""
    from distrain import __version__

    write_json(Path(path) / META_FILE, {**meta, "distrain_version": __version__})
    return (Path(path) / META_FILE).stat().st_size


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
    own = path / rank_file(dist.get_rank())
    rank_state = None
    if meta.get("world_size") == dist.get_world_size() and own.exists():
        rank_state = load_tensors(own)
    return meta, rank_state
