"""What a checkpoint's checksums cost, per GB:  python jobs/bench/bench_checksum.py

The commit manifest records a CRC-32 of every file (distrain/storage/integrity.py): each rank computes its
own files' as it commits, and a run (or export, generate) reads the whole checkpoint it loads once more to
verify it. This measures, on one core:

- `integrity.checksum` over a file of --size MiB just written (from the page cache: what a rank's commit
  reads), the file's plain read alone, and so the checksum's own share;
- the same bytes in memory under each checksum of Python's standard library that could do the job, the
  candidates CRC-32 was chosen from.

A cold read from the disk or a network file system adds that storage's own read time, the same for any
checksum.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import harness

sys.path.insert(0, str(harness.ROOT))
from distrain.storage import integrity  # noqa: E402

GB = 1e9
CANDIDATES: dict[str, Callable[[], object]] = {
    "zlib.crc32 (chosen)": lambda: _Folded(zlib.crc32, 0),
    "zlib.adler32": lambda: _Folded(zlib.adler32, 1),
    "hashlib.sha1": lambda: hashlib.sha1(),
    "hashlib.sha256": lambda: hashlib.sha256(),
    "hashlib.blake2b": lambda: hashlib.blake2b(),
    "hashlib.md5": lambda: hashlib.md5(),
}


class _Folded:
    """A running zlib checksum with hashlib's `update`."""

    def __init__(self, fn: Callable[[bytes, int], int], start: int):
        self.fn, self.value = fn, start

    def update(self, data: memoryview) -> None:
        self.value = self.fn(data, self.value)


def seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median of `repeats` timings of `fn`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_only(path: Path) -> None:
    buf = bytearray(integrity.CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def in_memory(make: Callable[[], object], data: memoryview) -> None:
    h = make()
    for at in range(0, len(data), integrity.CHUNK):
        h.update(data[at : at + integrity.CHUNK])


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "docs/checksum.md", repeats=5)
    p.add_argument("--size", type=int, default=512, help="MiB of random bytes measured (default 512, smoke 16)")
    args = harness.parse(p, argv)
    size = 16 if args.smoke else args.size
    page = harness.Page("Checkpoint checksums: their cost per GB", args)
    data = os.urandom(size << 20)
    with harness.storage(args) as where:
        path = where / "checksum.bin"
        path.write_bytes(data)
        read_s = seconds(lambda: read_only(path), args.repeats)
        crc_s = seconds(lambda: integrity.checksum(path), args.repeats)
        path.unlink()
    gb = len(data) / GB
    rows = [
        ["file read alone", f"{gb / read_s:.2f}", f"{read_s / gb:.3f}"],
        ["`integrity.checksum`: read + CRC-32", f"{gb / crc_s:.2f}", f"{crc_s / gb:.3f}"],
        ["its CRC-32's own share", "—", f"{(crc_s - read_s) / gb:.3f}"],
    ]
    view = memoryview(data)
    memory = {name: seconds(lambda make=make: in_memory(make, view), args.repeats) for name, make in CANDIDATES.items()}
    rows_memory = [[f"`{name}`", f"{gb / s:.2f}", f"{s / gb:.3f}"] for name, s in memory.items()]
    per_gb, share = crc_s / gb, (crc_s - read_s) / gb
    body = [
        f"- Settings: {size} MiB of random bytes, {integrity.CHUNK >> 20} MiB chunks, one thread; the median of "
        f"{args.repeats} timings each.",
        "",
        "## A file from the page cache, as a commit reads it",
        "",
        *harness.table(["what", "GB/s", "s per GB"], rows),
        "",
        "## The candidates, on bytes in memory",
        "",
        *harness.table(["checksum", "GB/s", "s per GB"], rows_memory),
        "",
        f"So a commit costs each rank {per_gb:.2f} s per GB of the files it wrote (in the background with "
        f"`checkpoint.async`, in the save's wait without), and a load costs the process that verifies the "
        f"checkpoint (the driver at a run's start and restarts; export; generate) a read of the whole checkpoint "
        f"from its storage plus {share:.2f} s per GB for the CRC-32, once per process while the files are "
        f"unchanged. Files are checked up to 8 at a time, so several cores and parallel storage divide that.",
    ]
    page.write("\n".join(body))


if __name__ == "__main__":
    main()
