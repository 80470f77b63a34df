"""Where a parameter server's shard file of a checkpoint lives (server.py writes and reads it).

On storage every node shares, each server writes into the driver's staging directory, which the driver renames
into the checkpoint. On an object store (run.storage=s3://…) each server writes into its own node's mirror of
the run, uploads its file to the checkpoint's prefix on the store once the driver has named the step, and
removes its copy: the driver commits the checkpoint there (the marker last, as ranks' checkpoints are:
storage/remote.py), and a server restored later fetches the checkpoint from the store into its node's mirror.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

from distrain.config import TrainConfig
from distrain.storage import checkpoint, integrity, remote
from distrain.storage.fsutil import write_json
from distrain.storage.objectstore import StorageError, store_for
from distrain.storage.safeload import DamagedCheckpointError


def staging_dir(cfg: TrainConfig, name: str) -> Path:
    """The staging directory `name` in this node's view of the run's checkpoints, made."""
    directory = Path(cfg.run_dir) / remote.PREFIX / name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def checksum(directory: Path, file: str) -> int:
    return integrity.checksums(directory, [file])[file]


def upload(cfg: TrainConfig, staging: str, file: str, prefix: str) -> str | None:
    """This node's `file` of the staging directory onto the store at `prefix`; why it could not be uploaded (the
    checkpoint is then not committed, the run goes on), or None. Removed here either way: uploaded, or of a
    checkpoint that will not commit (a staging directory is never loaded)."""
    directory = Path(cfg.run_dir) / remote.PREFIX / staging
    try:
        store_for(cfg.run_url, cfg.storage).upload(directory, [file], prefix)
    except StorageError as e:
        return str(e)
    finally:
        (directory / file).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            directory.rmdir()  # the last server's on this node (the driver's node: the driver's, with meta.json)
    return None


def restored(cfg: TrainConfig, resume_from: str) -> Path:
    """The checkpoint a server restores from, in this node's view: on an object store, fetched from there into
    the node's mirror (verified by its checksums) first."""
    if not cfg.run_url:
        return Path(resume_from)
    store = store_for(cfg.run_url, cfg.storage)
    step = checkpoint.step_of(checkpoint.name_of(resume_from))
    path = remote.fetch(store, Path(cfg.run_dir) / remote.PREFIX, step, only=True)
    if path is None:
        raise DamagedCheckpointError(f"{store.url}/{remote.PREFIX} no longer holds the checkpoint of step {step}")
    return path


def commit_on_store(
    committer: remote.Remote,
    servers: Any,
    staging: Path,
    step: int,
    files: dict[str, dict[str, int]],
    sums: dict[str, int],
    keep: int,
) -> bool:
    """The driver's commit of a checkpoint the servers (`servers`: their ServerGroup) saved into `staging` (this
    node's: meta.json in it): each server uploads its file, the driver meta.json; committed on the store once every
    object is there at its size (the marker last, storage/remote.py), then recorded in this node's mirror (meta.json
    and the marker; the servers' files are on the store), the newest `keep` kept. Whether it committed: a store
    that fails costs this checkpoint, said in one line, not the run."""
    prefix, store = f"{remote.PREFIX}/{checkpoint.step_dir('', step).name}", committer.store
    gone = remote.failure_of(lambda: store.remove(prefix))  # the objects of a save of this step that died
    errors = [gone] * len(files)
    if gone is None:
        errors = servers.call("upload", staging.name, prefix)
        errors.append(remote.failure_of(lambda: store.upload(staging, [checkpoint.META_FILE], prefix)))
    sums = {**sums, checkpoint.META_FILE: checksum(staging, checkpoint.META_FILE)}
    views = [(wrote, {f: sums[f] for f in wrote}, error) for wrote, error in zip(files.values(), errors, strict=True)]
    manifest = committer.commit_on_store(prefix, step, views, keep, list(files))
    if manifest is None:
        shutil.rmtree(staging, ignore_errors=True)
        return False
    write_json(staging / checkpoint.COMMIT_MARKER, manifest)
    root = staging.parent
    staging.rename(checkpoint.prepare(root, step))
    remote.prune_mirror(root, keep, step)
    return True
