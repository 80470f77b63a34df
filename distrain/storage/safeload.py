"""Loads that run no code: the run directory is shared storage that other people and jobs can write, so
nothing in a checkpoint is unpickled beyond tensors and plain data (a pickled callable would run in every
rank that resumes). A file that holds more is refused whole (UnsafeCheckpointError), never partly loaded;
one that is not what a save writes at all is damaged (DamagedCheckpointError), and checkpoint.latest falls
back past it. What a save may hold is checked before it is written (refuse_unplain)."""

from __future__ import annotations

import contextlib
import functools
import io
import pickle
from collections.abc import Sequence
from pathlib import Path, PosixPath
from typing import IO, Any


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds more than tensors and plain data (a pickled callable or class): loading
    it could run code someone planted in the run's storage, so it is refused. Retrying cannot help."""

    permanent = True  # read by the supervisor: the run ends at once, with this error's one line


class DamagedCheckpointError(RuntimeError):
    """Committed checkpoints exist but none can be loaded as it was saved (or a file is not what a save
    writes). Retrying cannot help; nothing is deleted, so a copy can be restored or the damaged one moved."""

    permanent = True  # read by the supervisor: the run ends at once, with this error's one line


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
