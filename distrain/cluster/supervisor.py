"""The supervisor: runs a function on a placed group until it completes, surviving failures.

A state machine: starting → running → recovering | resizing | stopping → finished | failed. A rank
that raises or dies is seen at once (the driver waits on the ranks' calls); a rank whose progress
stops for longer than the hang timeout counts as failed, after every rank's stacks are saved. A
failure costs one unit of the budget and starts a new attempt: healthy actors are kept, the others
replaced in their bundles, and the function runs again (it resumes from its own checkpoints). If
the full group cannot be placed again, the run goes on with the largest allowed size that fits and
grows back, at a checkpoint, when it can. The same error at the same step twice ends the run.

It knows nothing of models: an attempt is `make_attempt(world_size)` → (args, info), progress is
what ranks report (`step`, `phase`, timestamps), results are what they return (rank 0's `stopped`
says it stopped early on request).
"""

from __future__ import annotations

import enum
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ray.exceptions import RayActorError, RayError

from distrain.cluster.attempt import Attempt, Heartbeats, blame, mask, write_placement, write_stacks
from distrain.cluster.placement import (
    GroupSpec,
    PlacementError,
    WorkerFailure,
    draining_nodes,
    fitting_sizes,
    room_for,
)
from distrain.cluster.policy import Policy
from distrain.cluster.worker_group import WorkerGroup, first_line

MAX_BACKOFF_S = 60.0


class State(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    RESIZING = "resizing"
    STOPPING = "stopping"
    FINISHED = "finished"
    FAILED = "failed"


class Supervisor:
    def __init__(
        self,
        spec: GroupSpec,
        policy: Policy,
        fn: Callable[..., Any],
        make_attempt: Callable[[int], tuple[tuple, dict]],
        world_sizes: Sequence[int],
        run_dir: Path,
        on_progress: Callable[[dict], None] = lambda progress: None,
        on_event: Callable[[str], None] = lambda message: None,
    ):
        """world_sizes: the sizes the run may use, the one asked for (spec.num_workers) first."""
        self.spec, self.policy, self.fn, self.make_attempt = spec, policy, fn, make_attempt
        self.world_sizes, self.run_dir = list(world_sizes), run_dir
        self.on_progress, self.on_event = on_progress, on_event
        self.state = State.STARTING
        self.attempts: list[Attempt] = []
        self.failures = 0
        self.stop_requested_at: float | None = None
        self.step_times: list[float] = []
        self.group: WorkerGroup | None = None

    @property
    def restarts(self) -> int:
        return max(len(self.attempts) - 1, 0)

    def request_stop(self) -> None:
        """Ask for a clean stop (SIGTERM): the ranks checkpoint if time allows, then return."""
        self.stop_requested_at = self.stop_requested_at or time.time()

    def run(self) -> list[Any]:
        """The ranks' results from the attempt that finished (none if a stop request came during a
        failure); WorkerFailure when the run cannot finish."""
        try:
            placed = self._place(time.time(), patient=False, shrink=False)  # a run starts on all its workers
            while True:
                attempt = self._launch(placed)
                results = self._watch(attempt)
                if attempt.outcome == "resized" and not (results[0] or {}).get("stopped"):
                    attempt.outcome = "completed"  # it reached its end before the request
                if attempt.outcome in ("completed", "stopped") or self.stop_requested_at:
                    self.state = State.FINISHED
                    return results
                placed = self._recover(attempt)
        except BaseException:
            self.state = State.FAILED
            raise
        finally:
            if self.group is not None:
                self.group.shutdown()

    # -- placing ----------------------------------------------------------------------------------

    def _place(self, since: float, patient: bool, shrink: bool = True, torn_down_at: float | None = None) -> dict:
        """A new group of the full size, or, when that cannot be placed in placement_timeout_s (and
        `shrink`), of the largest allowed size the alive nodes can hold; with the attempt's times."""
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        timings = {"since": since, "torn_down_at": torn_down_at or time.time()}
        full = self.world_sizes[0]
        candidates = [full, *(fitting_sizes(self.spec, self.world_sizes[1:]) if shrink else [])]
        for n in candidates:
            group = WorkerGroup(replace(self.spec, num_workers=n))
            try:
                table = group.start(patient=patient and n == full)
            except PlacementError as e:
                if n == candidates[-1]:
                    if len(candidates) == 1:
                        raise
                    raise PlacementError(
                        f"{e}; no allowed smaller size (down to cluster.min_workers={self.world_sizes[-1]}) "
                        f"could be placed either"
                    ) from e
                self.on_event(f"{e}; trying fewer workers")
                continue
            self.group = group
            if n != full:
                self.state = State.RESIZING
                self.on_event(f"continuing on {n} of {full} workers; growing back when there is room")
            return {"table": table, **timings, "placed_at": time.time()}
        raise AssertionError("unreachable: the last candidate raises")

    def _launch(self, placed: dict) -> Attempt:
        table = placed.pop("table")
        args, info = self.make_attempt(len(table))
        attempt = Attempt(len(self.attempts) + 1, len(table), info, placed)
        self.attempts.append(attempt)
        write_placement(self.run_dir, attempt.number, table)
        self.group.launch(self.fn, *args)
        self.state = State.RUNNING
        return attempt

    # -- watching ---------------------------------------------------------------------------------

    def _watch(self, attempt: Attempt) -> list[Any]:
        """Until every rank has returned, or one failed or hung (then the results are empty)."""
        group, n = self.group, attempt.world_size
        beats = Heartbeats(n, self.step_times)
        results: dict[int, Any] = {}
        next_check = time.monotonic() + self.policy.node_check_s
        while len(results) < n:
            ended = group.poll(self.policy.poll_s)
            results.update((rank, value) for rank, value, error in ended if error is None)
            progress = group.progress()
            self.on_progress(progress[0])
            self._note(attempt, progress)
            errors = [(rank, error) for rank, _, error in ended if error is not None]
            if errors:
                self._failed(attempt, errors)
                return []
            beats.update(progress)
            hung = [r for r in range(n) if r not in results and beats.silent_s(r) > self._hang_limit(progress[r])]
            if hung:
                self._hung(attempt, hung, progress, beats)
                return []
            if attempt.outcome == "stopped" and time.time() > self.stop_requested_at + self.policy.stop_grace_s:
                attempt.cause = f"the ranks did not stop within {self.policy.stop_grace_s:g} s and were ended"
                break
            if attempt.outcome == "running":
                next_check = self._steer(attempt, next_check)
        if attempt.outcome == "running":
            attempt.outcome = "completed"
        final = group.last_progress(0)  # polls lag: the last report (the last step) may be unread
        self._note(attempt, [final])
        self.on_progress(final)
        attempt.timings["ended_at"] = time.time()
        return [results.get(rank) for rank in range(n)]

    def _note(self, attempt: Attempt, progress: list[dict]) -> None:
        """What the ranks' reports tell the record: the step reached, rank 0's start-up times."""
        attempt.step_reached = max([attempt.step_reached, *(p.get("step") or 0 for p in progress)])
        for key in ("joined_at", "loaded_at", "first_step_at"):
            if progress[0].get(key, 0) >= attempt.timings["placed_at"]:  # not a mark of the previous attempt
                attempt.timings.setdefault(key, progress[0][key])

    def _steer(self, attempt: Attempt, next_check: float) -> float:
        """Ask the ranks to stop at a checkpoint when the user wants to stop (SIGTERM), when a node
        of theirs is draining (it is about to be preempted), or when a shrunk run has room to grow
        back; the next attempt then starts where it should. Returns when to look at nodes again."""
        if self.stop_requested_at:
            self.state, attempt.outcome = State.STOPPING, "stopped"
            self.on_event("stop requested: checkpointing, then stopping")
            self.group.request_stop(self.stop_requested_at + self.policy.stop_grace_s - 1.0)
            return next_check
        if time.monotonic() < next_check:
            return next_check
        full, n = self.world_sizes[0], attempt.world_size
        draining = {e["node_id"] for e in self.group.table} & set(deadlines := draining_nodes())
        if draining:
            deadline = min(deadlines[node] for node in draining) or time.time() + self.policy.setup_timeout_s
            self.on_event(f"node {', '.join(d[:8] for d in draining)} is draining: checkpointing, then moving off it")
        elif n < full and room_for(self.spec, full - n):
            deadline = time.time() + self.policy.setup_timeout_s
            self.on_event(f"room for all {full} workers again: growing back at a checkpoint")
        else:
            return time.monotonic() + self.policy.node_check_s
        self.state, attempt.outcome = State.RESIZING, "resized"
        self.group.request_stop(deadline - 1.0)
        return next_check

    def _hang_limit(self, progress: dict) -> float:
        if progress.get("phase") != "train":
            return self.policy.setup_timeout_s
        recent = self.step_times[-50:]
        return self.policy.step_limit(statistics.median(recent) if recent else None)

    def _failed(self, attempt: Attempt, errors: list[tuple[int, RayError]]) -> None:
        attempt.timings["ended_at"] = time.time()
        deadline = time.monotonic() + self.policy.survivor_grace_s
        while self.group.calls and time.monotonic() < deadline:  # the others' errors too: then pick the cause
            errors += [(r, e) for r, _, e in self.group.poll(deadline - time.monotonic()) if e is not None]
        self._note(attempt, [self.group.last_progress(0)])  # rank 0's last marks, if it lives
        rank, error = min(errors, key=lambda item: blame(item[1]))
        attempt.outcome = "failed"
        attempt.cause = f"{self.group.who(rank)} failed: {first_line(error)}"
        attempt.error = str(error).strip()
        if not isinstance(error, RayActorError):  # a death (a kill, a lost node) is never called deterministic
            cause = getattr(error, "cause", None) or error
            step = self.group.last_progress(rank).get("step")  # exact: the rank's process is still there
            attempt.signature = (type(cause).__name__, mask(first_line(error)), step)

    def _hung(self, attempt: Attempt, hung: list[int], progress: list[dict], beats: Heartbeats) -> None:
        attempt.timings["ended_at"] = time.time()
        silent = max(beats.silent_s(r) for r in hung)
        steps = sorted({str(progress[r].get("step")) for r in hung})
        folder = write_stacks(self.run_dir, attempt.number, dict(enumerate(self.group.stacks())))
        mute = self.group.silent(longer_than_s=min(self._hang_limit(progress[r]) for r in hung))
        attempt.outcome = "hung"
        attempt.cause = (
            f"rank{'s' * (len(hung) > 1)} {', '.join(map(str, hung))} made no progress for {silent:.1f} s "
            f"(at step {', '.join(steps)})"
            + (f", rank {', '.join(map(str, mute))} not answering" if mute else "")
            + f"; stacks in {folder}"
        )
        self.group.returned.clear()  # all are stuck, in the step or in a collective: none is reused

    # -- recovering -------------------------------------------------------------------------------

    def _recover(self, attempt: Attempt) -> dict:
        """The group for the next attempt; WorkerFailure when the run should end instead."""
        since = attempt.timings["ended_at"]
        if attempt.outcome == "resized":
            return self._place(since, patient=False)
        self.failures += 1
        self._check_budget(attempt)
        self.state = State.RECOVERING
        budget = "unlimited" if self.policy.max_failures < 0 else self.policy.max_failures
        self.on_event(f"{attempt.cause}; recovering (failure {self.failures} of {budget})")
        time.sleep(self._backoff())
        if attempt.world_size < self.world_sizes[0]:
            return self._place(since, patient=True)
        self.group.release_unhealthy()  # the same group, its unhealthy actors replaced in their bundles
        torn_down = time.time()
        try:
            table = self.group.refill()
        except PlacementError as e:  # it waited placement_timeout_s already: shrink now if it must
            self.on_event(str(e))
            return self._place(since, patient=False, torn_down_at=torn_down)
        return {"table": table, "since": since, "torn_down_at": torn_down, "placed_at": time.time()}

    def _check_budget(self, attempt: Attempt) -> None:
        failed = [a for a in self.attempts if a.outcome == "failed"]
        if attempt.signature is not None and len(failed) > 1 and failed[-2].signature == attempt.signature:
            raise WorkerFailure(
                f"the same error at the same step in two attempts, so retrying cannot help: {attempt.cause}\n"
                f"{attempt.error}"
            )
        self.policy.check_budget(self.failures, attempt.cause, attempt.error)

    def _backoff(self) -> float:
        """No wait before the first retry after forward progress (a new highest step), then doubling
        waits while attempts keep failing without any."""
        best, stalled = 0, 0
        for a in self.attempts:
            best, stalled = (a.step_reached, 0) if a.step_reached > best else (best, stalled + 1)
        return 0.0 if stalled == 0 else min(MAX_BACKOFF_S, self.policy.restart_backoff_s * 2 ** (stalled - 1))
