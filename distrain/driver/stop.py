"""Signals that ask a run to stop: the driver checkpoints and exits instead of dying mid-step."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


class Stopped(KeyboardInterrupt):
    """A signal ended the run at once: nothing was left to save (or it was the second signal)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequests:
    """SIGTERM (`ray job stop`, a preempted node) or Ctrl-C asks for a clean stop: checkpoint, then exit.
    When there is nothing to save (attaching to Ray, placing and starting workers, a restart's back-off),
    and at a second signal, the run stops at once: the wait it is in is cut short (Ray's blocking calls let
    a signal through as KeyboardInterrupt), and `guard` turns that into `Stopped`. Signals reach only the
    main thread; elsewhere, nothing to do."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: list[int] = []  # the command line exits 128 + the first
        self.target: Callable[[], bool] | None = None

    def handler(self, signum: int, frame: object) -> None:
        if not self.received:
            self.received.append(signum)
            if self.target is not None and self.target():
                return  # the target stops cleanly
        raise KeyboardInterrupt

    def guard(self, wait: Callable[[], T]) -> T:
        """`wait()`, with a KeyboardInterrupt that a received signal caused raised as `Stopped`."""
        try:
            return wait()
        except KeyboardInterrupt:
            if not self.received:
                raise
            raise Stopped(self.received[0]) from None

    def install(self) -> dict:
        """Take the signals (again: `ray.init` puts in a SIGTERM handler of its own); the handlers replaced."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self.handler) for sig in self.SIGNALS}

    def forward_to(self, request_stop: Callable[[], bool]) -> None:
        """Signals go to `request_stop`, which returns whether it stops cleanly (False: stop at once)."""
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
