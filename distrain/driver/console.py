"""The driver's console, kept: what `jobs/train.py` prints (stdout and stderr) also goes to
`<run dir>/logs/driver-<timestamp>.log`, one file per invocation (per point of a sweep).

The run directory exists only once the config is valid, so what is printed before is held in memory
and written when the log opens; a refused command writes nothing. Python-level streams only: the
terminal still sees the same stream (a progress line still redraws), and output that bypasses Python
(a C library writing to fd 2) reaches the terminal but not the file. A line that holds for every point of
a sweep is said once (`once`).
"""

from __future__ import annotations

import io
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

LOG_DIR = "logs"
SAID: set[str] = set()  # lines `once` has said in this process


def once(say: Callable[[str], None], line: str) -> None:
    """`say(line)` unless this process has said it before: what holds for every run of a sweep (the cluster's
    devices, a sweep's points on one cluster) is said at its first point, and again only when it changes."""
    if line not in SAID:
        SAID.add(line)
        say(line)


class _Tee(io.TextIOBase):
    """A stream writing to the terminal's stream and to the driver log."""

    def __init__(self, stream: TextIO, log: DriverLog):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.keep(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.stream.encoding

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return self.stream.errors

    def __getattr__(self, name: str) -> object:  # the rest (buffer, errors, ...) is the stream's
        return getattr(self.stream, name)


class DriverLog:
    """Install once (`start`), then `open` a run directory's log and `close` it at the run's end."""

    def __init__(self) -> None:
        self.buffered: list[str] = []
        self.file: TextIO | None = None
        self.path: Path | None = None
        self.lock = threading.Lock()  # Ray prints its workers' output from threads of its own

    def start(self) -> None:
        sys.stdout, sys.stderr = _Tee(sys.stdout, self), _Tee(sys.stderr, self)

    def keep(self, text: str) -> None:
        with self.lock:
            if self.file is not None:
                self.file.write(text)
                self.file.flush()
            else:
                self.buffered.append(text)

    def open(self, run_dir: Path) -> Path:
        """Start the run directory's log of this invocation, with what was printed so far."""
        self.path = run_dir / LOG_DIR / f"driver-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6:06d}.log"
        self.path.parent.mkdir(exist_ok=True)
        with self.lock:
            self.file = open(self.path, "a")
            self.file.write("".join(self.buffered))
            self.buffered.clear()
        return self.path

    def close(self) -> None:
        with self.lock:
            if self.file is not None:
                self.file.close()
            self.file = None
