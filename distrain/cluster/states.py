"""The supervisor's states, each a class holding its data, the transitions allowed between them
(one table), and the interface through which a kind of training plugs into the supervisor.

    Placing ──▶ Running ──▶ Finished
                 │  ▲ ╲──▶ Stopping ──▶ Finished
                 │  │  ╲─▶ Resizing ──▶ Placing | Stopping | Recovering | Finished
                 ▼  │
               Recovering ──▶ Placing | Rejoining | Running, Resizing (one worker replaced) | Finished | Failed
                                         └──▶ Running (from the live replicas' memory)

Any state but the two final ones may also end in Failed (an error the run cannot survive).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from distrain.cluster.attempt import Attempt, Failure, Heartbeats
from distrain.cluster.worker import Fn

if TYPE_CHECKING:
    from distrain.cluster.worker_group import WorkerGroup


@dataclass(frozen=True)
class Work:
    """What an attempt's ranks run, fn(*args, channel), and where the engine's other actors run."""

    fn: Fn
    args: tuple
    others: list[dict] = field(default_factory=list)
    note: str = ""  # a line for the user as the attempt starts (where its state comes from, when not as planned)


class AttemptLost(RuntimeError):
    """An engine lost a part of the attempt that lives outside the ranks (a parameter server):
    only a new attempt from the last checkpoint helps."""


class Engine(Protocol):
    """What a kind of training brings to the supervisor. The supervisor places the workers,
    watches them and carries out what its failure policy decides a failure means; the engine says
    what runs on the ranks and what else an attempt needs, and it never loops on its own."""

    replaces_workers: bool  # a failed worker is replaced while the others go on; else the group restarts

    def warm_up(self) -> tuple[Fn, tuple]:
        """fn and args a hot spare runs while it waits for a rank: what the rank's function imports and reads."""

    def begin(self, group: WorkerGroup, attempt: Attempt) -> Work:
        """Prepare an attempt on a placed group: what else it needs (parameter servers); note in
        attempt.info where it resumes from. Returns what the ranks run (the supervisor launches it)."""

    def from_replicas(self, group: WorkerGroup) -> tuple[bool, str]:
        """After a failure, the failed ranks' workers let go and the others kept: whether the next attempt can
        start from the state the kept ones hold in memory (every shard of it at one step) rather than from the
        checkpoint, and the line that says which and why ("" when the engine never recovers so)."""

    def tick(self, suspect: bool) -> None:
        """Work between the supervisor's looks (a parameter server's metrics and checkpoints); AttemptLost
        when the attempt cannot go on. `suspect`: a worker just failed, perhaps because of that."""

    def replaced(self, rank: int) -> None:
        """`rank`'s worker was replaced (replaces_workers only): let go of what the dead one held."""

    def request_stop(self, deadline: float) -> None:
        """Beyond telling the ranks (the supervisor does): what else must stop by `deadline`."""

    def finish(self, results: list[Any]) -> dict:
        """The attempt's results once every rank returned (rank 0's, or the engine's own record);
        `stopped` in them says a stop request ended it before the last step."""

    def end(self, keep: bool = False) -> None:
        """The attempt is over, however it went: let go of what `begin` started, or `keep` it for the
        next run of this driver (the run ended well, with cluster.reuse_workers)."""


@dataclass
class Placing:
    """Placing a group for a new attempt: the failed one refilled (healthy actors kept, spares first),
    or a new one (the full size, else a smaller allowed one when `shrink`)."""

    since: float  # the failure, stop or start this attempt follows
    torn_down_at: float | None = None
    refill: bool = False
    patient: bool = False  # wait for the full size up to placement_timeout_s even if nodes are missing now
    shrink: bool = True


@dataclass
class Rejoining(Placing):
    """The failed ranks' places refilled (hot spares first) while the other workers keep their processes and
    the training state in their memory, which the next attempt starts from instead of a checkpoint."""

    refill: bool = True


@dataclass
class Watching:
    """An attempt whose ranks are running."""

    attempt: Attempt
    beats: Heartbeats
    results: dict[int, Any] = field(default_factory=dict)  # rank → what its call returned


@dataclass
class Running(Watching):
    next_node_check: float = 0.0  # monotonic time of the next look for draining nodes and room


@dataclass
class Stopping(Watching):
    """Stop requested (SIGTERM): the ranks checkpoint if time allows, then return."""

    deadline: float = 0.0  # wall clock: after it the ranks are ended


@dataclass
class Resizing(Watching):
    """The ranks were asked to checkpoint and return so that the run can move: off a draining node,
    or back onto the full size."""

    why: str = ""


@dataclass
class Recovering:
    watching: Watching  # the attempt that failed, as it was being watched
    failures: list[Failure]


@dataclass
class Finished:
    results: dict | None  # None: a stop came while the ranks could not report (a failure during it)
    stopped: bool


@dataclass
class Failed:
    error: BaseException


State = Placing | Rejoining | Running | Stopping | Resizing | Recovering | Finished | Failed
FINAL = (Finished, Failed)
TRANSITIONS: dict[type, set[type]] = {
    Placing: {Running, Failed},
    Rejoining: {Running, Failed},
    Running: {Running, Stopping, Resizing, Recovering, Finished, Failed},
    Stopping: {Stopping, Finished, Failed},
    Resizing: {Resizing, Placing, Stopping, Recovering, Finished, Failed},
    Recovering: {Placing, Rejoining, Running, Resizing, Finished, Failed},
    Finished: set(),
    Failed: set(),
}


class InvalidTransition(RuntimeError):
    """The supervisor tried a transition the table does not allow: a bug in the supervisor."""


def check_transition(old: State, new: State) -> None:
    if type(new) not in TRANSITIONS[type(old)]:
        raise InvalidTransition(f"{type(old).__name__} → {type(new).__name__} is not an allowed transition")
