"""Signals that ask a run to stop: the driver checkpoints and exits instead of dying mid-step."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

DEFAULT_STOP_GRACE_S = 30.0
RAY_JOB_STOP_WAIT_DEFAULT_S = 3.0  # Ray's own default (dashboard/modules/job/job_supervisor.py)


class Stopped(KeyboardInterrupt):
    """A signal ended the run at once: nothing was left to save (or it was the second signal)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StoppedBeforeStart(Stopped):
    """A signal ended the run before it had trained a step or recorded a failure: a run directory this invocation
    made holds nothing worth keeping (`rerun.claimed` empties it). Any other interrupt keeps every file."""


def _say(text: str) -> None:
    print(f"distrain: {text}", file=sys.stderr, flush=True)


class StopRequests:
    """SIGTERM (`ray job stop`, a preempted node) or Ctrl-C asks for a clean stop: checkpoint, then exit.
    When there is nothing to save (attaching to Ray, placing and starting workers, ranks that have not made
    a step, a restart's back-off), and at a second signal, the run stops at once: the wait it is in is cut
    short (Ray's blocking calls let a signal through as KeyboardInterrupt), and `guard` turns that into
    `Stopped`. Signals reach only the main thread; elsewhere, nothing to do."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: list[int] = []  # every signal, in order: the command line exits 128 + the first
        self.target: Callable[[], bool] | None = None
        self.say: Callable[[str], None] = _say
        # A signal asked to stop at once. Its KeyboardInterrupt may never reach a `guard`: raised inside a fork
        # handler (Ray starting its processes), a finaliser or a callback, Python prints it as ignored and goes on.
        self.at_once = False

    def handler(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        if len(self.received) == 1 and self.target is not None and self.target():
            return  # the target stops cleanly
        self.at_once = True
        raise KeyboardInterrupt

    def guard(self, wait: Callable[[], T]) -> T:
        """`wait()`, with a KeyboardInterrupt that a received signal caused raised as `Stopped`; Stopped too
        when such a signal came before the wait or while it ran without interrupting it. A second signal is
        acknowledged in one line."""
        try:
            if not self.at_once:
                result = wait()
                if not self.at_once:
                    return result
        except KeyboardInterrupt:
            if not self.received:
                raise
        if len(self.received) > 1:
            name = signal.Signals(self.received[-1]).name
            self.say(f"{name} again: stopping now, without waiting for the ranks' checkpoint")
        raise Stopped(self.received[0]) from None

    def install(self) -> dict:
        """Take the signals (again: `ray.init` puts in a SIGTERM handler of its own); the handlers replaced."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self.handler) for sig in self.SIGNALS}

    def forward_to(self, request_stop: Callable[[], bool], say: Callable[[str], None] | None = None) -> None:
        """Signals go to `request_stop`, which returns whether it stops cleanly (False: stop at once); `say`
        acknowledges a second signal."""
        self.target = request_stop
        self.say = say or self.say


@contextlib.contextmanager
def stop_signals() -> Iterator[StopRequests]:
    stop = StopRequests()
    previous = stop.install()
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def exit_at_signal(code: int) -> None:
    """From here on (the driver's last lines said, Ray's exit hook to run), a signal, a user's second Ctrl-C
    say, ends the process at once with `code`, in one line: not with a traceback out of Ray's exit hook. The
    embedded cluster's processes end with it (Ray has the kernel kill them when their parent dies)."""

    def leave(signum: int, frame: object) -> None:
        _say(f"{signal.Signals(signum).name}: exiting now (exit status {code})")
        sys.stdout.flush()
        os._exit(code)

    for sig in StopRequests.SIGNALS:
        signal.signal(sig, leave)


def stop_grace_s() -> float:
    """How long after SIGTERM the driver still lives: under `ray job submit` (which sets
    RAY_JOB_CONFIG_JSON_ENV_VAR for the driver), RAY_JOB_STOP_WAIT_TIME_S, 3 s unless the job's
    env_vars say otherwise; elsewhere (a terminal, a scheduler) 30 s unless that variable is set."""
    under_ray_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
    default = RAY_JOB_STOP_WAIT_DEFAULT_S if under_ray_job else DEFAULT_STOP_GRACE_S
    return float(os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", default))
