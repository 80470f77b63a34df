"""A supervised run's history: its attempts, the failures its policy judged, the workers replaced while the
others went on, and the placement last written to the run directory. The supervisor adds to it as the run
goes; summary.json records it (`summary`), unless a stop came before anything happened."""

from __future__ import annotations

import time
from pathlib import Path

from distrain.cluster.attempt import Attempt, Failure, Mark, Outcome, write_placement


class History:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.attempts: list[Attempt] = []
        self.failures: list[Failure] = []
        self.replacements: list[dict] = []  # workers replaced while the others went on
        self._placement: list[dict] = []  # as last written to the run directory

    def begin(self, world_size: int, since: float, torn_down_at: float | None, reserved_at: float | None) -> Attempt:
        """A new attempt on a group placed now; `reserved_at` marks it when the group is its own (not refilled or
        kept: reserved since the attempt's start)."""
        timings = {Mark.SINCE: since, Mark.TORN_DOWN: torn_down_at, Mark.PLACED: time.time()}
        if (reserved_at or 0) >= since:
            timings[Mark.RESERVED] = reserved_at
        attempt = Attempt(len(self.attempts) + 1, world_size, {}, timings)
        self.attempts.append(attempt)
        return attempt

    def replaced(self, rank: int, failure: Failure, step: int | None) -> None:
        self.replacements.append({"worker": rank, "cause": failure.cause, "at_step": step, "time": failure.at})

    def place(self, attempt: Attempt, placement: list[dict]) -> None:
        """Where the attempt's ranks, warm spares and other actors run, written whenever that changed."""
        if placement != self._placement:
            write_placement(self.run_dir, attempt.number, placement)
            self._placement = placement

    @property
    def restarts(self) -> int:
        return len(self.replacements) + max(len(self.attempts) - 1, 0)

    @property
    def progressed(self) -> bool:
        """Whether any attempt has made a step."""
        return any(a.progressed for a in self.attempts)

    def summary(self) -> dict:
        """summary.json's record of the attempts."""
        return {
            "attempts": [a.record() for a in self.attempts],
            "replacements": self.replacements,
            "restarts": self.restarts,
            "steps_executed": sum(a.steps_run for a in self.attempts),
        }


def nothing_happened(attempts: list[Attempt]) -> bool:
    """Whether no attempt trained a step or ended in a failure: a stop then leaves no record (a failure's is kept)."""
    return not any(a.progressed or a.outcome in (Outcome.FAILED, Outcome.HUNG) for a in attempts)
