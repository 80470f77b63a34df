"""The checksums a checkpoint's commit manifest records, and the check that its files still match them.

A size catches a truncated file but not bytes overwritten in place (a bad disk block, a stray write on
shared storage), which DCP would load as if whole: a damaged tensor trains on as NaN. So the manifest
also holds a CRC-32 of every file: zlib's, the fastest sound checksum in Python's standard library
(6.4 GB/s on one core here, against 1.8 for SHA-256 and 1.3 for BLAKE2b: docs/checksum.md). It finds
accidental damage (every burst of up to 32 bits, any other with probability 1 − 2⁻³²), which is its job:
it is no defence against someone who can rewrite the manifest too.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHUNK = 8 << 20  # bytes read at a time: large enough that reading and zlib dominate, not Python
_verdicts: dict[Path, tuple[tuple, str | None]] = {}  # directory → (its files' stat signature, verdict)


def checksum(path: str | Path) -> int:
    """The CRC-32 of a file's bytes, read in chunks into one buffer (zlib releases the GIL meanwhile)."""
    crc, buf = 0, bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


def checksums(directory: Path, names: Iterable[str]) -> dict[str, int]:
    """Each named file's checksum, several files at a time (storage that serves parallel reads faster)."""
    names = list(names)
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(names), os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(lambda name: checksum(directory / name), names), strict=True))


def mismatch(directory: Path, recorded: dict[str, int]) -> str | None:
    """Which file no longer has the checksum its commit recorded, or None. A directory whose files have not
    changed since it was checked (same sizes, modification and change times, inodes) is not read again:
    a run checks its checkpoint in the driver and again at every restart."""
    try:
        signature = tuple((name, *_stamp(os.stat(directory / name))) for name in sorted(recorded))
    except OSError as e:
        return f"{Path(e.filename).name} is unreadable ({e.strerror})"
    cached = _verdicts.get(directory)
    if cached is not None and cached[0] == signature:
        return cached[1]
    try:
        found = checksums(directory, sorted(recorded))
    except OSError as e:
        return f"{Path(e.filename).name} is unreadable ({e.strerror})"
    bad = [name for name in sorted(recorded) if found[name] != recorded[name]]
    verdict = None
    if bad:
        which = bad[0] if len(bad) == 1 else f"{bad[0]} and {len(bad) - 1} more files"
        verdict = (
            f"{which} no longer match{'es' * (len(bad) == 1)} the checksum the commit recorded (damaged after "
            f"it was written)"
        )
    _verdicts[directory] = (signature, verdict)
    return verdict


def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino
