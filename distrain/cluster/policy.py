"""How a supervised run treats trouble: its timeouts, and one policy object whose methods return
decisions (restart the group, replace one worker, shrink, give up) for every kind of training."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from distrain.cluster.attempt import Failure, FailureKind

HANG_STEPS = 10  # the automatic hang timeout, in typical step times
MAX_BACKOFF_S = 60.0


class Decision(enum.StrEnum):
    RESTART = "restart"  # a new attempt from the last checkpoint; healthy actors are kept
    REPLACE = "replace"  # a new worker (a hot spare if there is one) takes the failed rank; the others go on
    SHRINK = "shrink"  # a new attempt on fewer workers: the full group cannot be placed
    GIVE_UP = "give up"


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str = ""  # GIVE_UP: why, for the error the run ends with
    size: int = 0  # SHRINK: the worker count to go on with


@dataclass(frozen=True)
class Policy:
    max_failures: int = 3  # failures survived; -1: no limit
    hang_timeout_s: float | None = None  # None: HANG_STEPS median step times, at least min_hang_timeout_s
    min_hang_timeout_s: float = 60.0
    setup_timeout_s: float = 600.0  # the limit outside training steps: start-up, checkpoints, evaluation
    restart_backoff_s: float = 1.0  # the wait before a retry that follows a failure without progress; doubles
    stop_grace_s: float = 30.0  # after a stop request, how long the ranks get to checkpoint and return
    survivor_grace_s: float = 3.0  # after a failure, how long the other ranks get to return (and be reused)
    # Progress, hang and stop-request checks; a death or an error is seen at once regardless. A stop
    # request waits for the next check, and under `ray job stop` the driver has 3 s in all.
    poll_s: float = 0.5
    # How often a run looks for draining nodes and, shrunk, for room to grow back: each look at room
    # places a trial placement group (up to 0.5 s).
    node_check_s: float = 5.0

    def step_limit(self, step_s: float | None) -> float:
        """How long a training step may go without progress: hang_timeout_s, else HANG_STEPS typical
        step times (step_s), at least min_hang_timeout_s."""
        if self.hang_timeout_s is not None:
            return self.hang_timeout_s
        return max(self.min_hang_timeout_s, HANG_STEPS * (step_s or 0.0))

    def decide(self, failure: Failure, earlier: list[Failure], replaces_workers: bool) -> Verdict:
        """What to do about `failure`, given the run's earlier failures (oldest first) and whether its
        engine can replace one worker while the others go on (a parameter server can, a process group
        cannot: it restarts together). The same error at the same step twice in a row is a bug, not bad
        luck: retrying cannot help; so is a process group that fails to form twice with the same kind of
        error (ranks that cannot reach each other), and an error that says so of itself (`permanent`). A
        death (a kill, a lost node) is never called that."""
        count = len(earlier) + 1
        if failure.permanent:
            return Verdict(Decision.GIVE_UP, failure.cause)
        if failure.signature is not None and earlier and earlier[-1].signature == failure.signature:
            if failure.joining:
                return Verdict(
                    Decision.GIVE_UP,
                    f"the ranks could not form their process group, twice the same way, so retrying cannot help: "
                    f"{failure.cause}; check that the hosts reach each other at these addresses, or name the "
                    f"interface to use with cluster.env_vars.GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME on GPUs)",
                )
            return Verdict(
                Decision.GIVE_UP, f"the same error at the same step twice, so retrying cannot help: {failure.cause}"
            )
        if 0 <= self.max_failures < count:
            return Verdict(
                Decision.GIVE_UP,
                f"{failure.cause}; that is failure {count}, over cluster.max_failures={self.max_failures}",
            )
        one_worker = failure.rank is not None and failure.kind != FailureKind.LOST
        return Verdict(Decision.REPLACE if replaces_workers and one_worker else Decision.RESTART)

    def size(self, full: int, fitting: list[int]) -> Verdict:
        """After the full group could not be placed in time: the largest allowed size the alive
        nodes can hold (`fitting`, largest first), or give up."""
        if fitting:
            return Verdict(Decision.SHRINK, size=fitting[0])
        return Verdict(Decision.GIVE_UP, f"could not place {full} workers, and no smaller allowed size fits")

    def backoff(self, steps_reached: list[int]) -> float:
        """No wait before the first retry after forward progress (a new highest step: `steps_reached`
        of the attempts so far), then doubling waits while attempts keep failing without any."""
        best, stalled = 0, 0
        for reached in steps_reached:
            best, stalled = (reached, 0) if reached > best else (best, stalled + 1)
        return 0.0 if stalled == 0 else min(MAX_BACKOFF_S, self.restart_backoff_s * 2 ** (stalled - 1))
