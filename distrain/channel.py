"""What a rank's function and the supervisor share while it runs: the channel (progress up, a stop
request down) and the phases a rank reports. Neither Ray nor torch: both layers use it."""

from __future__ import annotations

import enum
import time


class Phase(enum.StrEnum):
    """What a rank is doing; the supervisor judges silence by it (a step may take seconds, a
    checkpoint minutes, a parameter-server worker may wait on a server for as long as it takes)."""

    JOIN = "join"  # joining the process group
    SETUP = "setup"  # building the model, loading a checkpoint
    TRAIN = "train"
    EVAL = "eval"
    CHECKPOINT = "checkpoint"
    WAIT = "wait"  # on something outside the rank (a server, a held run): never a hang


class Channel:
    """The supervisor's line to a rank: progress up (`report` phase, step, timestamps), a stop request
    down (`stop_deadline`: the wall-clock time by which it wants the rank to have returned, or None).
    The worker actor holds it and answers the supervisor's questions from it while the rank runs."""

    def __init__(self) -> None:
        self.progress: dict = {}
        self.stop_deadline: float | None = None

    def report(self, progress: dict) -> None:
        """Merge `progress` into what the supervisor reads. After a failure a rank says what it does on its
        way back under "returning" (its phase stays the one it failed in)."""
        self.progress = {**self.progress, **progress, "time": time.time()}
