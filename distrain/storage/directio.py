"""Direct file I/O for the NVMe tier: files streamed in chunks through a few page-aligned host buffers.

Reads and writes use O_DIRECT: the bytes go between the disk and the buffers without the page cache, so
streaming gigabytes of optimizer state neither fills host memory with cache nor reads back what the cache
kept (which would also flatter the bandwidth). `os.preadv`/`os.pwrite` release the GIL, so a reader and a
writer thread move chunks while the caller computes. Torch-free: the driver checks a directory with
`problem` before any worker starts.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

BLOCK = 4096  # O_DIRECT's unit: offsets, lengths and buffer addresses are multiples of it
BUFFERS = 3  # one being read ahead, one being updated, one being written behind
MIN_CHUNK_BYTES = 256 * 1024  # per file and buffer: below this, a chunk's system calls cost more than its bytes
IN_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def chunk_bytes(pool_bytes: int, files: int) -> int:
    """Bytes of each file a buffer holds when `pool_bytes` of host memory hold BUFFERS buffers (0: too small)."""
    size = pool_bytes // (BUFFERS * files) // BLOCK * BLOCK
    return size if size >= MIN_CHUNK_BYTES else 0


def min_pool_bytes(files: int) -> int:
    return BUFFERS * files * MIN_CHUNK_BYTES


def filesystem_type(path: str | Path) -> str:
    """The type of the file system holding `path`, from the longest mount point above it."""
    path, best = os.path.realpath(path), ("", "")
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mount, kind, *_ = line.split()
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[0]):
                best = (mount, kind)
    return best[1]


def problem(directory: str | Path, need_bytes: int) -> str | None:
    """Why `directory` cannot hold `need_bytes` of streamed files, in words that end with the fix; None if it can."""
    d = Path(directory)
    if not d.is_dir():
        return f"{d} is {'not a directory' if d.exists() else 'missing'}: create it on a local disk, or choose another"
    kind = filesystem_type(d)
    if kind in IN_MEMORY_FILESYSTEMS:
        return f"{d} is on {kind}, which lives in host memory, the memory NVMe offload spares: choose a local disk"
    try:
        fd, probe = tempfile.mkstemp(prefix=".distrain-probe-", dir=d)
    except OSError as e:
        return f"{d} is not writable ({e.strerror}): choose a directory this user can write"
    os.close(fd)
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_DIRECT))
    except OSError as e:
        return f"{d} does not allow direct I/O (O_DIRECT: {e.strerror}): choose a directory on a local disk"
    finally:
        os.unlink(probe)
    free = shutil.disk_usage(d).free
    if free < need_bytes:
        return (
            f"{d} has {free / 2**30:.2f} GiB free but the optimizer state needs {need_bytes / 2**30:.2f} GiB: "
            f"free {(need_bytes - free) / 2**30:.2f} GiB there, or choose a larger disk"
        )
    return None


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous memory, page-aligned as O_DIRECT requires."""
    return mmap.mmap(-1, nbytes)


def open_direct(path: Path, nbytes: int) -> int:
    """A new file of `nbytes` (a multiple of BLOCK) for direct I/O, its blocks reserved now: a full disk fails
    here, at start-up, not in the middle of a step. It reads as zeros until written."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    return fd


def read_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n


def write_from(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class Stream:
    """Equal-sized files, each cut into chunks of `chunk` bytes; chunk k of every file is read into one of
    BUFFERS buffers, handed to an update, and written back. With `overlap` the reader thread reads chunk
    k+1 and the writer thread writes chunk k−1 while chunk k is updated; without, one after the other."""

    def __init__(self, paths: Sequence[Path], nbytes: int, chunk: int):
        assert nbytes % BLOCK == 0 and chunk % BLOCK == 0 and chunk > 0
        self.nbytes, self.chunk = nbytes, min(chunk, nbytes)
        self.fds = [open_direct(p, nbytes) for p in paths]
        self.buffers = [[aligned_buffer(chunk) for _ in paths] for _ in range(BUFFERS)]
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="nvme-read")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="nvme-write")

    @property
    def chunks(self) -> int:
        return -(-self.nbytes // self.chunk)

    def _move(self, k: int, move: Callable) -> None:
        offset = k * self.chunk
        size = min(self.chunk, self.nbytes - offset)
        for fd, buffer in zip(self.fds, self.buffers[k % BUFFERS], strict=True):
            move(fd, memoryview(buffer)[:size], offset)

    def run(self, update: Callable[[int, int], None], overlap: bool = True) -> None:
        """`update(k, b)` for every chunk k in order, once chunk k of each file is in buffer b."""
        if not overlap:
            for k in range(self.chunks):
                self._move(k, read_into)
                update(k, k % BUFFERS)
                self._move(k, write_from)
            return
        reads: dict[int, Future] = {}
        writes: dict[int, Future] = {}

        def read_ahead(j: int) -> None:
            if j < self.chunks:
                if j - BUFFERS in writes:  # the buffer is free once its last chunk is on disk
                    writes.pop(j - BUFFERS).result()
                reads[j] = self.reader.submit(self._move, j, read_into)

        try:
            read_ahead(0)
            for k in range(self.chunks):
                read_ahead(k + 1)
                reads.pop(k).result()
                update(k, k % BUFFERS)
                writes[k] = self.writer.submit(self._move, k, write_from)
        finally:  # nothing left moving into or out of a buffer, whatever happened
            for future in [*reads.values(), *writes.values()]:
                future.exception()
        for future in writes.values():
            future.result()

    def close(self) -> None:
        self.reader.shutdown()
        self.writer.shutdown()
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def sequential_bandwidth(directory: Path, nbytes: int, chunk: int) -> dict[str, float]:
    """The disk's raw sequential write and read speed (bytes/s) with the same calls, alignment and chunk
    size the Stream uses, one chunk at a time: the reference the optimizer step's bandwidth is judged by."""
    path = directory / ".distrain-bandwidth"
    fd, buffer = open_direct(path, nbytes), aligned_buffer(chunk)
    buffer.write(os.urandom(chunk))
    speeds = {}
    try:
        for kind, move in (("write", write_from), ("read", read_into)):
            start = time.perf_counter()
            for offset in range(0, nbytes, chunk):
                move(fd, memoryview(buffer)[: min(chunk, nbytes - offset)], offset)
            os.fsync(fd)
            speeds[kind] = nbytes / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()
    return speeds
