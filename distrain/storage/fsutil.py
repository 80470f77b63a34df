"""Files of a run directory: writes never seen half-done, and a lock so one run has one writer. Neither
torch nor Ray: the driver and the trainer both use it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def make_writable_dir(path: Path) -> list[Path]:
    """Make `path` (and its missing parents) and write a file in it once: OSError if that cannot be done,
    with the directories made here removed again. Returns the directories it made, deepest first."""
    made = [p for p in (path, *path.parents) if not p.exists()]
    probe = path / f".write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError:
        remove_empty(made)
        raise
    return made


def remove_empty(directories: list[Path]) -> None:
    """Remove each of `directories` (deepest first) that is empty; leave the others."""
    for directory in directories:
        with contextlib.suppress(OSError):
            directory.rmdir()


def write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


class LockedError(RuntimeError):
    """Another live process holds the lock."""


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike) -> Iterator[None]:
    """A lock file created with O_EXCL, naming its holder's host and PID. A lock left by a dead
    process on this host is taken over; one held elsewhere must be removed by hand if stale."""
    path = Path(path)
    me = {"host": socket.gethostname(), "pid": os.getpid()}
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
            except (OSError, ValueError):
                holder = {}
            if holder.get("host") == me["host"] and not alive(holder.get("pid", -1)):
                path.unlink(missing_ok=True)  # its holder died without cleaning up
                continue
            raise LockedError(
                f"{path.parent} is in use by pid {holder.get('pid')} on {holder.get('host')}; wait for that run, "
                f"or delete {path} if it is no longer running"
            ) from None
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def alive(pid: int) -> bool:
    """Whether process `pid` of this host lives (someone else's included); never for 0 or a negative
    number, which os.kill takes for process groups."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    return pid > 0
