"""The supervisor: runs one kind of training (an Engine: collective training, or the parameter server)
on a placed worker group until it finishes, surviving failures.

A state machine (distrain/cluster/states.py): `run` calls `_step` until a final state, and `_step`
does one unit of work for the current state and returns the next. What went wrong is the diagnosis's
(diagnosis.py: a rank that raises or dies is seen at once, one silent past its limit is hung, after its
stacks are saved); what it means is the failure policy's (policy.py): a new attempt from the last
checkpoint with the healthy actors kept and the others replaced (hot spares first), one worker replaced
while the others go on, a smaller group when the full one cannot be placed, or the end of the run; when
a running attempt moves (a draining node, room to grow back) is the scaling policy's. The supervisor
carries the decisions out, and knows nothing of models.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from distrain.cluster.attempt import Attempt, Failure, FailureKind, Heartbeats, Mark, Outcome, write_placement
from distrain.cluster.diagnosis import Diagnosis
from distrain.cluster.placement import GroupSpec, PlacementError, WorkerFailure, fitting_sizes
from distrain.cluster.policy import Decision, FailurePolicy, ScalingPolicy, Verdict
from distrain.cluster.states import (
    FINAL,
    AttemptLost,
    Engine,
    Failed,
    Finished,
    Placing,
    Recovering,
    Rejoining,
    Resizing,
    Running,
    State,
    Stopping,
    Watching,
    Work,
    check_transition,
)
from distrain.cluster.timeouts import Timeouts
from distrain.cluster.worker_group import WorkerGroup


class Supervisor:
    def __init__(
        self,
        spec: GroupSpec,
        policy: FailurePolicy,
        timeouts: Timeouts,
        engine: Engine,
        world_sizes: Sequence[int],
        run_dir: Path,
        on_progress: Callable[[dict], None] = lambda progress: None,
        on_event: Callable[[str], None] = lambda message: None,
        reuse_workers: bool = False,
    ):
        """world_sizes: the sizes the run may use, the one asked for (spec.num_workers) first.
        reuse_workers: keep the group for the next run of this driver when this one ends well."""
        self.spec, self.policy, self.timeouts, self.engine = spec, policy, timeouts, engine
        self.world_sizes, self.run_dir = list(world_sizes), run_dir
        self.on_progress, self.on_event, self.reuse_workers = on_progress, on_event, reuse_workers
        self.state: State = Placing(since=time.time(), shrink=False)  # a run starts on all its workers
        self.attempts: list[Attempt] = []
        self.failures: list[Failure] = []
        self.replacements: list[dict] = []  # workers replaced while the others went on
        self.stop_requested_at: float | None = None
        self.group: WorkerGroup | None = None
        self.work: Work | None = None  # what the current attempt's ranks run
        self._placement: list[dict] = []  # as last written to the run directory
        self.diagnosis = Diagnosis(engine, timeouts, run_dir, lambda: self.stop_requested_at, on_progress, on_event)
        self.scaling = ScalingPolicy(spec, self.world_sizes[0], timeouts.setup_timeout_s)

    @property
    def restarts(self) -> int:
        return len(self.replacements) + max(len(self.attempts) - 1, 0)

    def request_stop(self) -> bool:
        """Ask for a clean stop (SIGTERM, Ctrl-C): the ranks checkpoint if time allows, then return (at once if
        none has made a step yet: `_stopping`). False when no attempt's ranks run (workers being placed or
        started, a restart's back-off): nothing to save, and the caller may end the run at once."""
        self.stop_requested_at = self.stop_requested_at or time.time()
        launched = self.group is not None and bool(self.group.calls)  # the ranks' calls went out in Placing
        return isinstance(self.state, Watching) or launched

    def run(self) -> Finished:
        """Step the state machine to its end: Finished, or the error that made it Failed, raised."""
        try:
            while not isinstance(self.state, FINAL):
                self._enter(self._step())
        except BaseException as e:
            self._enter(Failed(e))
            raise
        finally:
            keep = self.reuse_workers and isinstance(self.state, Finished) and self.state.results is not None
            self.engine.end(keep)
            if self.group is not None:
                self.group.release() if keep else self.group.shutdown()
        return self.state

    def _enter(self, state: State) -> None:
        check_transition(self.state, state)
        self.state = state

    def _step(self) -> State:
        match self.state:
            case Rejoining() | Placing():
                return self._place(self.state)
            case Running():
                return self._run(self.state)
            case Stopping():
                return self._stop(self.state)
            case Resizing():
                return self._resize(self.state)
            case Recovering():
                return self._recover(self.state)
        raise AssertionError(f"no step from {self.state}")

    # -- Placing ----------------------------------------------------------------------------------

    def _place(self, s: Placing) -> Running:
        table = None
        if s.refill:
            try:
                table = self.group.refill()
            except PlacementError as e:  # it waited placement_timeout_s already: shrink now if it may
                self.on_event(str(e))
        if table is None:
            table = self._new_group(s)
        now = time.time()
        timings = {Mark.SINCE: s.since, Mark.TORN_DOWN: s.torn_down_at, Mark.PLACED: now}
        if (self.group.reserved_at or 0) >= s.since:  # a group of its own, not refilled or kept
            timings[Mark.RESERVED] = self.group.reserved_at
        attempt = Attempt(len(self.attempts) + 1, len(table), {}, timings)
        self.attempts.append(attempt)
        self.work = self.engine.begin(self.group, attempt)
        timings[Mark.LAUNCHED] = time.time()  # before the calls go: a warm rank may begin before the last is sent
        self.group.launch(self.work.fn, *self.work.args)
        if self.work.note:
            self.on_event(self.work.note)
        self._write_placement(attempt)
        beats = Heartbeats(len(table), self.diagnosis.step_times)
        return Running(attempt, beats, next_node_check=self._next_node_check())

    def _new_group(self, s: Placing) -> list[dict]:
        """A new group of the full size, or, when that cannot be placed in placement_timeout_s (and
        `shrink`), of the largest allowed size the alive nodes can hold."""
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        s.torn_down_at = s.torn_down_at or time.time()  # the placement below is not part of the teardown
        full = self.world_sizes[0]
        try:
            return self._start_group(full, patient=s.patient)
        except PlacementError as e:
            if not s.shrink or len(self.world_sizes) == 1:
                raise
            verdict = self.policy.size(full, fitting_sizes(self.spec, self.world_sizes[1:]))
            if verdict.decision == Decision.GIVE_UP:
                raise PlacementError(
                    f"{e}; {verdict.reason} (down to cluster.min_workers={self.world_sizes[-1]})"
                ) from e
            self.on_event(str(e))
            self.on_event(f"continuing on {verdict.size} of {full} workers; growing back when there is room")
            return self._start_group(verdict.size, patient=False)

    def _start_group(self, n: int, patient: bool) -> list[dict]:
        group = WorkerGroup(replace(self.spec, num_workers=n), self.engine.warm_up())
        table = group.start(patient=patient)
        self.group = group
        return table

    # -- Running, Stopping, Resizing --------------------------------------------------------------

    def _run(self, s: Running) -> State:
        failures = self.diagnosis.look(self.group, s)
        if failures:
            return Recovering(s, failures)
        if self._done(s):
            return self._finish(s)
        if s.attempt.progressed:
            self.group.restock()  # the attempt made a step: a new spare's warm-up no longer slows its start
        self._write_placement(s.attempt)  # when a spare has come up
        if self.stop_requested_at:
            return self._stopping(s)
        if time.monotonic() >= s.next_node_check:
            move = self.scaling.decide({e["node_id"] for e in self.group.table}, s.attempt.world_size)
            if move is not None:
                self.on_event(move.why)
                self._ask_to_stop(move.deadline - 1.0)
                return Resizing(s.attempt, s.beats, s.results, why=move.why)
            s.next_node_check = self._next_node_check()
        return s

    def _stop(self, s: Stopping) -> State:
        failures = self.diagnosis.look(self.group, s)
        if failures:  # the stop is what was asked for: no new attempt
            s.attempt.end(Outcome.FAILED, failures[0])
            return Finished(None, stopped=True)
        if self._done(s):
            return self._finish(s)
        if time.time() > s.deadline:
            s.attempt.cause = f"the ranks did not stop within {self.timeouts.stop_grace_s:g} s and were ended"
            s.attempt.end(Outcome.STOPPED)
            return Finished(None, stopped=True)
        return s

    def _resize(self, s: Resizing) -> State:
        failures = self.diagnosis.look(self.group, s)
        if failures:
            return Recovering(s, failures)
        if self._done(s):
            finished = self._finish(s)
            if not isinstance(finished, Finished) or not finished.stopped:
                return finished  # a failure at the end, or it reached the end before the request
            s.attempt.outcome = Outcome.RESIZED
            return Placing(since=time.time())
        if self.stop_requested_at:
            return self._stopping(s)
        return s

    def _stopping(self, s: Watching) -> Stopping | Finished:
        """A stop was requested: ask every rank (and the engine) to checkpoint and return by the deadline; or,
        while no attempt has made a step (as the ranks say now: polls lag), end the attempt: nothing to save."""
        s.attempt.note(list(self.group.final_progress(timeout_s=self.timeouts.poll_s).values()))  # in rank order
        if not any(a.progressed for a in self.attempts):
            s.attempt.end(Outcome.STOPPED)
            return Finished(None, stopped=True)
        deadline = self.stop_requested_at + self.timeouts.stop_grace_s
        self.on_event("stop requested: checkpointing, then stopping")
        self._ask_to_stop(deadline - 1.0)  # a second kept for the driver
        return Stopping(s.attempt, s.beats, s.results, deadline=deadline)

    def _ask_to_stop(self, deadline: float) -> None:
        self.group.request_stop(deadline)
        self.engine.request_stop(deadline)

    def _done(self, s: Watching) -> bool:
        return len(s.results) == s.attempt.world_size and not self.group.calls

    def _finish(self, s: Watching) -> State:
        """Every rank returned: the engine's results, and the attempt's outcome."""
        final = self.group.last_progress(0)  # polls lag: the last report (the last step) may be unread
        s.attempt.note([final])
        self.on_progress(final)
        try:
            results = self.engine.finish([s.results[r] for r in range(s.attempt.world_size)])
        except AttemptLost as e:
            return Recovering(s, [Failure(FailureKind.LOST, str(e))])
        stopped = bool(results.get("stopped"))
        s.attempt.end(Outcome.STOPPED if stopped else Outcome.COMPLETED)
        return Finished(results, stopped=stopped)

    def _next_node_check(self) -> float:
        return time.monotonic() + self.timeouts.node_check_s

    # -- Recovering -------------------------------------------------------------------------------

    def _recover(self, s: Recovering) -> State:
        """The policy's verdict on each failure, carried out: the run ends at the first GIVE_UP; the failed
        workers are replaced when every verdict says REPLACE and the engine can; else a new attempt, which
        starts from the kept workers' memory when the engine says it holds every shard (no back-off: the
        failure lost no step), or else from the last checkpoint."""
        verdicts: list[tuple[Failure, Verdict]] = []
        for failure in s.failures:
            verdict = self.policy.decide(failure, tuple(self.failures), self.engine.replaces_workers)
            if verdict.decision not in (Decision.RESTART, Decision.REPLACE, Decision.GIVE_UP):
                raise TypeError(f"{type(self.policy).__name__}.decide returned {verdict}: RESTART, REPLACE or GIVE_UP")
            self.failures.append(failure)
            if verdict.decision == Decision.GIVE_UP:
                s.watching.attempt.end(Outcome.HUNG if failure.kind == FailureKind.HUNG else Outcome.FAILED, failure)
                detail = failure.error and not failure.permanent  # its class's words say it all
                raise WorkerFailure(f"{verdict.reason}" + (f"\n{failure.error}" if detail else ""))
            verdicts.append((failure, verdict))
        if self.engine.replaces_workers and all(
            v.decision == Decision.REPLACE and f.rank is not None for f, v in verdicts
        ):
            for failure, verdict in verdicts:
                self._replace(s.watching, failure, verdict)
            return s.watching
        failure, verdict = next(((f, v) for f, v in verdicts if v.decision != Decision.REPLACE), verdicts[0])
        attempt = s.watching.attempt
        attempt.end(Outcome.HUNG if failure.kind == FailureKind.HUNG else Outcome.FAILED, failure)
        self.engine.end()
        if self.stop_requested_at:
            return Finished(None, stopped=True)
        self.on_event(verdict.noted(f"{failure.cause}; recovering"))
        since = attempt.timings[Mark.ENDED]
        shrunk = attempt.world_size < self.world_sizes[0]
        if not shrunk:
            if failure.kind == FailureKind.HUNG:
                self.group.returned.clear()  # all are stuck, in the step or in a collective: none is reused
            self.group.release_unhealthy()
            replicas, why = self.engine.from_replicas(self.group)
            if why:
                self.on_event(f"recovering {why}" if replicas else f"restarting from the last checkpoint: {why}")
            if replicas:
                return Rejoining(since=since, torn_down_at=time.time())
        self._sleep(self.timeouts.backoff([a.step_reached for a in self.attempts]))
        if self.stop_requested_at:
            return Finished(None, stopped=True)
        if shrunk:  # try the full size again
            return Placing(since=since, patient=True)
        return Placing(since=since, torn_down_at=time.time(), refill=True)

    def _replace(self, watching: Watching, failure: Failure, verdict: Verdict) -> None:
        """One worker replaced while the others go on (a hot spare if one is warm)."""
        rank = failure.rank
        self.on_event(verdict.noted(f"{failure.cause}; replacing it while the others go on"))
        step = self.group.last_progress(rank, timeout_s=0.5).get("step")
        self.group.replace(rank)
        watching.beats.restart(rank)
        self.engine.replaced(rank)
        self.group.launch(self.work.fn, *self.work.args, ranks=[rank])
        self._write_placement(watching.attempt)
        self.replacements.append({"worker": rank, "cause": failure.cause, "at_step": step, "time": failure.at})

    def _write_placement(self, attempt: Attempt) -> None:
        """Where the attempt's ranks, warm spares and other actors run, whenever that changed."""
        placement = [*self.group.placement(), *self.work.others]
        if placement != self._placement:
            write_placement(self.run_dir, attempt.number, placement)
            self._placement = placement

    def _sleep(self, seconds: float) -> None:
        """Wait, unless a stop request comes meanwhile."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.stop_requested_at:
            time.sleep(max(0.0, min(0.1, end - time.monotonic())))  # end may pass meanwhile
