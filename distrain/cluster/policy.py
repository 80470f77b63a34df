"""How a supervised run treats trouble: its timeouts and its failure budget, shared by the
supervisor and the parameter-server driver."""

from __future__ import annotations

from dataclasses import dataclass

from distrain.cluster.placement import WorkerFailure

HANG_STEPS = 10  # the automatic hang timeout, in typical step times


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

    def check_budget(self, failures: int, cause: str, error: str | None) -> None:
        """WorkerFailure once `failures` is over max_failures (-1: never)."""
        if 0 <= self.max_failures < failures:
            raise WorkerFailure(
                f"{cause}; that is failure {failures}, over cluster.max_failures={self.max_failures}"
                + (f"\n{error}" if error else "")
            )
