"""One attempt of a supervised run: its record, its ranks' heartbeats, and how its errors are read."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from ray.exceptions import RayActorError, RayError

from distrain.fsutil import write_json


@dataclass
class Attempt:
    """One run of the function on one group: what summary.json records of it."""

    number: int
    world_size: int
    info: dict
    timings: dict  # wall-clock times: since (the failure or start it follows), torn_down_at, placed_at, ...
    outcome: str = "running"  # completed | stopped | resized | failed | hung
    cause: str | None = None
    error: str | None = None  # the failing rank's error, with its traceback
    step_reached: int = 0
    signature: tuple | None = None  # (error type, message without numbers, step): a repeat is a bug

    def record(self) -> dict:
        t = self.timings
        spans = {  # the recovery (or start-up) this attempt began with, phase by phase
            "teardown_s": ("since", "torn_down_at"),
            "placement_s": ("torn_down_at", "placed_at"),
            "process_group_s": ("placed_at", "joined_at"),
            "checkpoint_load_s": ("joined_at", "loaded_at"),
            "first_step_s": ("loaded_at", "first_step_at"),
            "total_s": ("since", "first_step_at"),
        }
        recovery = {k: round(t[b] - t[a], 3) for k, (a, b) in spans.items() if a in t and b in t}
        out = {k: v for k, v in vars(self).items() if v is not None and k != "signature"}
        return {**out, "recovery": recovery}


class Heartbeats:
    """When each rank's (step, phase) last changed, on the driver's clock, and rank 0's step times."""

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
            if rank == 0 and old and old[1] == key[1] == "train" and key[0] > old[0]:
                self.step_times.append((now - self.changed[0]) / (key[0] - old[0]))
            self.seen[rank], self.changed[rank] = key, now

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
