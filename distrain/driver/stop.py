"""Signals that ask a run to stop: the driver checkpoints and exits instead of dying mid-step."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


class StopRequests:
    """SIGTERM (`ray job stop`, a preempted node) or Ctrl-C asks for a clean stop: checkpoint, then exit;
    during start-up (Ray starting, workers being placed), the run stops before its first attempt. A second
    one stops at once. Signals reach only the main thread; elsewhere, nothing to do."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: list[int] = []  # the command line exits 128 + the first
        self.target: Callable[[], None] | None = None

    def handler(self, signum: int, frame: object) -> None:
        if self.received:
            raise KeyboardInterrupt
        self.received.append(signum)
        if self.target is not None:
            self.target()

    def install(self) -> dict:
        """Take the signals (again: `ray.init` puts in a SIGTERM handler of its own); the handlers replaced."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self.handler) for sig in self.SIGNALS}

    def forward_to(self, request_stop: Callable[[], None]) -> None:
        self.target = request_stop


@contextlib.contextmanager
def stop_signals() -> Iterator[StopRequests]:
    stop = StopRequests()
    previous = stop.install()
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
