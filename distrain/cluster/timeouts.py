"""The supervisor's clocks: how long a rank may stay silent, how long a stop or a retry waits, how often
it looks. Data, not decisions: what a failure means is the failure policy's (policy.py)."""

from __future__ import annotations

from dataclasses import dataclass

HANG_STEPS = 10  # the automatic hang timeout, in typical step times
MAX_BACKOFF_S = 60.0


@dataclass(frozen=True)
class Timeouts:
    hang_timeout_s: float | None = None  # None: HANG_STEPS median step times, at least min_hang_timeout_s
    min_hang_timeout_s: float = 60.0
    setup_timeout_s: float = 600.0  # the limit outside training steps: start-up, checkpoints, evaluation
    restart_backoff_s: float = 1.0  # the wait before a retry that follows a failure without progress; doubles
    stop_grace_s: float = 30.0  # after a stop request, how long the ranks get to checkpoint and return
    # After a failure, how long another rank that has not yet noticed it gets to return (and be reused): most
    # notice at once, their collectives failing with it. One that has noticed, on its way back, gets return_limit.
    survivor_grace_s: float = 3.0
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

    def return_limit(self, returning: bool, step_s: float | None) -> float:
        """How long after a failure another rank may take to return, by what it last said: on its way back
        (keeping its state, leaving its process group: work a loaded machine makes slow, never to be cut
        short) the step limit; still in its step, survivor_grace_s or three typical steps, whichever is
        longer. Never more than setup_timeout_s."""
        limit = self.step_limit(step_s) if returning else max(self.survivor_grace_s, 3 * (step_s or 0.0))
        return min(limit, self.setup_timeout_s)

    def backoff(self, steps_reached: list[int]) -> float:
        """No wait before the first retry after forward progress (a new highest step: `steps_reached`
        of the attempts so far), then doubling waits while attempts keep failing without any."""
        best, stalled = 0, 0
        for reached in steps_reached:
            best, stalled = (reached, 0) if reached > best else (best, stalled + 1)
        return 0.0 if stalled == 0 else min(MAX_BACKOFF_S, self.restart_backoff_s * 2 ** (stalled - 1))
