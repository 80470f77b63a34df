"""One attempt of a supervised run: its record, what went wrong in it, its ranks' heartbeats, and
how errors are read."""

from __future__ import annotations

import enum
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from ray.exceptions import RayActorError, RayError

from distrain.channel import Phase
from distrain.storage.fsutil import write_json


class Outcome(enum.StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"  # the ranks reached the end
    STOPPED = "stopped"  # on request (SIGTERM), at a checkpoint
    RESIZED = "resized"  # stopped at a checkpoint to move: a draining node, or room to grow back
    FAILED = "failed"  # a rank died or raised, or the engine lost a part of it (a parameter server)
    HUNG = "hung"  # a rank made no progress for too long


class Mark(enum.StrEnum):
    """Wall-clock marks of an attempt's start: the supervisor's own, then rank 0's reports (Attempt.note)."""

    SINCE = "since"  # the failure (or start, or resize) it follows
    TORN_DOWN = "torn_down_at"
    RESERVED = "reserved_at"  # a new group's placement group ready (absent when the group was refilled or kept)
    PLACED = "placed_at"  # its actors started and ranked
    LAUNCHED = "launched_at"  # the ranks' calls about to be sent
    RUNNING = "running_at"  # rank 0's call began: its function imported (torch, for the trainer)
    JOINED = "joined_at"  # rank 0 joined the process group
    LOADED = "loaded_at"  # model built, checkpoint loaded
    FIRST_STEP = "first_step_at"
    ENDED = "ended_at"


RANK_MARKS = (Mark.RUNNING, Mark.JOINED, Mark.LOADED, Mark.FIRST_STEP)
RECOVERY = {  # the recovery (or start-up) an attempt begins with, phase by phase: name → (from, to)
    "teardown_s": (Mark.SINCE, Mark.TORN_DOWN),
    "placement_s": (Mark.TORN_DOWN, Mark.PLACED),
    "process_group_s": (Mark.PLACED, Mark.JOINED),
    "checkpoint_load_s": (Mark.JOINED, Mark.LOADED),
    "first_step_s": (Mark.LOADED, Mark.FIRST_STEP),
    "total_s": (Mark.SINCE, Mark.FIRST_STEP),
}


class FailureKind(enum.StrEnum):
    DIED = "died"  # the rank's process is gone (a kill, a lost node)
    RAISED = "raised"  # the rank's code raised; its process lives
    HUNG = "hung"
    LOST = "lost"  # a part of the attempt outside the ranks (a parameter server)


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    cause: str  # one line: who, and what
    rank: int | None = None  # None: not one rank's (a hang of several, a lost server)
    error: str | None = None  # the whole error with its traceback
    signature: tuple | None = None  # RAISED: (error type, message without numbers, step); a repeat is a bug
    joining: bool = False  # RAISED or HUNG while joining the process group: its rendezvous failed
    permanent: bool = False  # RAISED an error whose class says retrying cannot help (`permanent = True`)
    at: float = field(default_factory=time.time)


@dataclass
class Attempt:
    """One run of the ranks' function on one group: what summary.json records of it."""

    number: int
    world_size: int
    info: dict
    timings: dict[str, float]  # Mark → wall-clock time
    outcome: Outcome = Outcome.RUNNING
    cause: str | None = None
    error: str | None = None  # the failing rank's error, with its traceback
    step_reached: int = 0
    step_begun: int = 0  # the last step any rank began: with a failure, the one in flight

    def end(self, outcome: Outcome, failure: Failure | None = None) -> None:
        self.outcome = outcome
        if failure is not None:
            self.cause, self.error = failure.cause, failure.error
        self.timings.setdefault(Mark.ENDED, failure.at if failure is not None else time.time())

    def note(self, progress: list[dict]) -> None:
        """What the ranks' reports tell the record: the step reached, and the start-up marks of the first
        report (rank 0's; after a failure that killed rank 0, the lowest living rank's: the marks of ranks
        that share a process group lie fractions of a second apart)."""
        self.step_reached = max([self.step_reached, *(p.get("step") or 0 for p in progress)])
        self.step_begun = max([self.step_begun, self.step_reached, *(p.get("began") or 0 for p in progress)])
        for mark in RANK_MARKS:
            if progress and progress[0].get(mark, 0) >= self.timings[Mark.PLACED]:  # not the previous attempt's
                self.timings.setdefault(mark, progress[0][mark])

    @property
    def progressed(self) -> bool:
        """Whether a step has ended since the state it started from (a checkpoint's, the replicas', nothing)."""
        return self.step_reached > self.info.get("resumed_from_step", 0)

    @property
    def steps_run(self) -> int:
        """The steps this attempt began (finished or not) after the one it resumed from."""
        return max(0, self.step_begun - self.info.get("resumed_from_step", 0))

    def record(self) -> dict:
        t = self.timings
        recovery = {k: round(t[b] - t[a], 3) for k, (a, b) in RECOVERY.items() if a in t and b in t}
        out = {k: v for k, v in vars(self).items() if v is not None}
        timings = {str(k): v for k, v in t.items()}
        return {**out, "steps_run": self.steps_run, "timings": timings, "recovery": recovery}


class Heartbeats:
    """When each rank's (step, phase) last changed, on the driver's clock, and the recent step times
    of every rank: a rank that goes silent for many of them is hung."""

    def __init__(self, n: int, step_times: list[float]):
        now = time.monotonic()
        self.seen: list[tuple | None] = [None] * n
        self.changed = [now] * n
        self.step_times = step_times

    def update(self, progress: list[dict]) -> None:
        now = time.monotonic()
        for rank, p in enumerate(progress):
            key = (p.get("step"), p.get("phase"))
            old = self.seen[rank]
            if key == old:
                continue
            if old and old[1] == key[1] == Phase.TRAIN and None not in (old[0], key[0]) and key[0] > old[0]:
                self.step_times.append((now - self.changed[rank]) / (key[0] - old[0]))
            self.seen[rank], self.changed[rank] = key, now

    def restart(self, rank: int) -> None:
        """A rank's worker was replaced: its silence counts from now."""
        self.seen[rank], self.changed[rank] = None, time.monotonic()

    def silent_s(self, rank: int) -> float:
        return time.monotonic() - self.changed[rank]


def blame(error: RayError) -> int:
    """Which error is the cause: one the rank's own code raised, then a dead process, then the
    errors its peers saw in collectives because of it (gloo's lost connections, NCCL's aborts)."""
    if isinstance(error, RayActorError):
        return 1
    cause = getattr(error, "cause", None) or error
    collective = any(c.__name__ == "DistError" for c in type(cause).__mro__)
    return 2 if collective or any(word in str(cause) for word in ("gloo/transport", "NCCL")) else 0


def mask(text: str) -> str:
    """An error's message without the numbers that differ between attempts (PIDs, addresses)."""
    return re.sub(r"0x[0-9a-f]+|\d+", "#", text)


def first_line(error: Exception, limit: int = 160) -> str:
    """The error's type and the last line of its message (where Python puts the exception's own
    words), cut to `limit` characters: Ray's death notices run to a paragraph."""
    cause = getattr(error, "cause", None) or error
    lines = str(cause).strip().splitlines()
    line = lines[-1] if lines else ""
    return f"{type(cause).__name__}: {line if len(line) <= limit else line[: limit - 1] + '…'}"


def write_placement(run_dir: Path, attempt: int, placement: list[dict]) -> None:
    """Where an attempt's actors run: kept per attempt, and the current one as placement.json."""
    (run_dir / "attempts").mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "attempts" / f"{attempt:03d}-placement.json", placement)
    write_json(run_dir / "placement.json", placement)


def write_stacks(run_dir: Path, attempt: int, stacks: dict[int, str]) -> Path:
    """Each rank's Python stacks, as the supervisor took them before ending a hung attempt; the folder."""
    folder = run_dir / "attempts" / f"{attempt:03d}-stacks"
    folder.mkdir(parents=True, exist_ok=True)
    for rank, text in stacks.items():
        (folder / f"rank_{rank:05d}.txt").write_text(text)
    return folder
