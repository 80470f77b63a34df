"""What a rank's function and the supervisor share while it runs: the channel (progress up, a stop
request down), the phases a rank reports and the record of its reports. Neither Ray nor torch: both
layers use it."""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field, replace


class Phase(enum.StrEnum):
    """What a rank is doing; the supervisor judges silence by it (a step may take seconds, a
    checkpoint minutes, a parameter-server worker may wait on a server for as long as it takes)."""

    JOIN = "join"  # joining the process group
    SETUP = "setup"  # building the model, loading a checkpoint
    TRAIN = "train"
    EVAL = "eval"
    CHECKPOINT = "checkpoint"
    WAIT = "wait"  # on something outside the rank (a server, a held run): never a hang


@dataclass(frozen=True)
class Progress:
    """What a rank has reported, each field as last said: the supervisor judges it by its step and phase, the
    console line shows its step and figures, the attempt's record takes its start-up marks. It crosses Ray
    whole (the worker actor answers the supervisor's questions with it); None: not said yet."""

    phase: Phase | None = None
    step: int | None = None  # the step under way
    max_steps: int | None = None
    began: int | None = None  # the last step begun: after a failure, the one that was in flight
    logged: int | None = None  # the step `metrics` are of (a collective rank reads a loss back a step later)
    metrics: dict[str, float] = field(default_factory=dict)  # the newest logged figure of each name
    said: tuple[str, ...] = ()  # the rank's lines for the user (a checkpoint not committed)
    returning: str | None = None  # after a failure, what the rank does on its way back
    # Start-up marks, wall-clock: the process's call began, it joined the process group, its state loaded.
    running_at: float | None = None
    joined_at: float | None = None
    loaded_at: float | None = None
    first_step_at: float | None = None


class Channel:
    """The supervisor's line to a rank: progress up (`report`), a stop request down (`stop_deadline`: the
    wall-clock time by which it wants the rank to have returned, or None). The worker actor holds it and
    answers the supervisor's questions from it while the rank runs. A rank reports from more than one thread (a
    background checkpoint says it did not commit while the step reports its figures): each report is one
    read-modify-write under a lock, or one would write back a Progress without the other's news."""

    def __init__(self) -> None:
        self.progress = Progress()
        self.stop_deadline: float | None = None
        self._lock = threading.Lock()

    def report(self, metrics: dict[str, float] | None = None, **changed: object) -> None:
        """Say what changed, by `Progress`'s field names (None: unchanged; a name it lacks is a TypeError);
        figures join those said before. After a failure a rank says what it does on its way back (`returning`:
        its phase stays the one it failed in)."""
        said_now = {name: value for name, value in changed.items() if value is not None}
        with self._lock:
            figures = {**self.progress.metrics, **(metrics or {})}
            self.progress = replace(self.progress, **said_now, metrics=figures)
