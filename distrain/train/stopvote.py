"""The ranks' vote on a stop the supervisor asked for: every rank stops at the same step, and no step waits for it."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class StopVote:
    def __init__(self) -> None:
        self.cast: tuple[dist.Work, torch.Tensor] | None = None  # the vote in flight

    def count(self, stop_deadline: float | None, last_save_s: float, last: bool) -> tuple[bool, bool]:
        """Whether the supervisor asked any rank to stop (`stop_deadline`), and whether a checkpoint still fits
        before its deadline (judged by the last save's duration, start to commit). Every rank casts its vote after
        each step, an all-reduce (MAX) of two numbers in CPU memory that runs while the next step computes, and
        counts the previous step's: every rank gets the same answer at the same step, a step after the
        request, and no step waits for the vote. The last step's vote is counted at once."""
        # float64 from the start: float32 holds a wall-clock time (about 1.8e9 s) only to 128 s.
        votes = torch.tensor([stop_deadline or 0.0, time.time() + last_save_s], dtype=torch.float64)
        cast = (dist.all_reduce(votes, op=dist.ReduceOp.MAX, async_op=True), votes)
        counted, self.cast = (cast, None) if last else (self.cast, cast)
        if counted is None:
            return False, False
        counted[0].wait()
        deadline, ready_by = counted[1].tolist()
        return deadline > 0, ready_by <= deadline

    def close(self) -> None:
        """No collective is left in flight."""
        if self.cast is not None:
            self.cast[0].wait()
