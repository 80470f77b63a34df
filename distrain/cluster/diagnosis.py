"""What went wrong in a watched attempt, read from its ranks: their results and errors, their progress, who
is silent past their phase's limit, and which failure is the cause (attempt.blame). The supervisor takes one
look per poll and acts on the failures it gets; the policy (policy.py) says what each means."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ray.exceptions import RayActorError

from distrain.channel import Phase
from distrain.cluster.attempt import Attempt, Failure, FailureKind, Heartbeats, blame, first_line, mask, write_stacks
from distrain.cluster.states import AttemptLost
from distrain.cluster.timeouts import Timeouts

if TYPE_CHECKING:
    from distrain.cluster.states import Engine, Watching
    from distrain.cluster.worker_group import WorkerGroup

# The signature of every failure to form the process group, raised or timed out: ranks that cannot reach each
# other fail alike on every attempt, whatever each one's words, and the second time in a row ends the run.
JOINING = ("joining",)


class Diagnosis:
    def __init__(
        self,
        engine: Engine,
        timeouts: Timeouts,
        run_dir: Path,
        stop_requested_at: Callable[[], float | None],
        on_progress: Callable[[dict], None],
        on_event: Callable[[str], None],
    ):
        """stop_requested_at: when a stop was asked for (None: not yet), read at each use."""
        self.engine, self.timeouts, self.run_dir = engine, timeouts, run_dir
        self.stop_requested_at, self.on_progress, self.on_event = stop_requested_at, on_progress, on_event
        self.step_times: list[float] = []  # every rank's, every attempt's: the typical step

    def look(self, group: WorkerGroup, s: Watching) -> list[Failure]:
        """One look at the ranks (waiting up to poll_s for one to end): their results, the engine's
        work, progress; the failures it found, empty if none."""
        attempt = s.attempt
        ended = group.poll(self.timeouts.poll_s)
        s.results.update((rank, value) for rank, value, error in ended if error is None)
        errors = [(rank, error) for rank, _, error in ended if error is not None]
        try:
            self.engine.tick(suspect=bool(errors))
        except AttemptLost as e:
            return [Failure(FailureKind.LOST, str(e))]
        progress = group.progress()
        self.on_progress(progress[0])
        attempt.note(progress)
        if errors:
            failures = self._failed(group, errors)
            alive = group.final_progress(timeout_s=0.5)  # polls lag: the last reports, of those alive
            attempt.note([alive[r] for r in sorted(alive)])  # marks from rank 0's, or the lowest living rank's
            return failures
        s.beats.update(progress)
        hung = [
            r
            for r in range(attempt.world_size)
            if r not in s.results and s.beats.silent_s(r) > self._limit(progress[r])
        ]
        return [self._hung(group, attempt, hung, progress, s.beats)] if hung else []

    def _limit(self, progress: dict) -> float:
        """How long a rank may stay silent in its phase: a step, a few typical step times; waiting on
        something outside the rank, for ever; anything else (start-up, a checkpoint), setup_timeout_s."""
        phase = progress.get("phase")
        if phase == Phase.WAIT:
            return float("inf")
        if phase != Phase.TRAIN:
            return self.timeouts.setup_timeout_s
        return self.timeouts.step_limit(self._typical_step_s())

    def _typical_step_s(self) -> float | None:
        recent = self.step_times[-50:]
        return statistics.median(recent) if recent else None

    def _failed(self, group: WorkerGroup, errors: list[tuple[int, Exception]]) -> list[Failure]:
        """The failure (collective training: the one to blame, after the others' errors came in) or the
        failures (an engine that replaces workers one by one)."""
        seen = time.time()
        if not self.engine.replaces_workers:
            errors += self._others_return(group)  # their errors too: then pick the cause
            errors = [min(errors, key=lambda item: blame(item[1]))]
        return [self._failure(group, rank, error, seen) for rank, error in errors]

    def _others_return(self, group: WorkerGroup) -> list[tuple[int, Exception]]:
        """Wait for the other ranks' calls to end after a failure, each as long as what it last said allows
        (Timeouts.return_limit: a rank on its way back is never cut short for being slow); their errors. A rank
        still out past its limit is named, with what it was doing, and is ended with the attempt."""
        start, errors, said, step_s = time.monotonic(), [], {}, self._typical_step_s()
        while group.calls:
            ranks = sorted(group.calls.values())
            said.update(group.final_progress(ranks, timeout_s=self.timeouts.poll_s))  # asked: polls lag
            waited = time.monotonic() - start
            doing = {rank: said.get(rank, {}).get("returning") for rank in ranks}
            stop_at = self.stop_requested_at()
            if stop_at and time.time() > stop_at + self.timeouts.stop_grace_s - 1:
                break  # a stop asked for: the driver's grace is what is left to wait
            if all(waited > self.timeouts.return_limit(bool(doing[rank]), step_s) for rank in ranks):
                for rank in ranks:
                    self.on_event(
                        f"{group.who(rank)} did not return within {waited:.1f} s of the failure "
                        f"({doing[rank] or 'still in its step'}): it is ended with the attempt"
                    )
                break
            errors += [(r, e) for r, _, e in group.poll(self.timeouts.poll_s) if e is not None]
        return errors

    def _failure(self, group: WorkerGroup, rank: int, error: Exception, seen: float) -> Failure:
        cause = f"{group.who(rank)} failed: {first_line(error)}"
        if isinstance(error, RayActorError):  # a death (a kill, a lost node) is never called deterministic
            return Failure(FailureKind.DIED, cause, rank, str(error).strip(), at=seen)
        progress = group.last_progress(rank)  # exact: the rank's process is still there
        raised = type(getattr(error, "cause", None) or error)
        kind = raised.__name__
        if getattr(raised, "permanent", False):  # e.g. a checkpoint refused as unsafe: no retry can help
            cause = f"{group.who(rank)} failed: {first_line(error, limit=1000)}"  # its advice, uncut
            return Failure(FailureKind.RAISED, cause, rank, str(error).strip(), permanent=True, at=seen)
        if progress.get("phase") == Phase.JOIN:
            cause = joining(group, cause)
            return Failure(FailureKind.RAISED, cause, rank, str(error).strip(), JOINING, joining=True, at=seen)
        signature = (kind, mask(first_line(error)), progress.get("step"))
        return Failure(FailureKind.RAISED, cause, rank, str(error).strip(), signature, at=seen)

    def _hung(
        self, group: WorkerGroup, attempt: Attempt, hung: list[int], progress: list[dict], beats: Heartbeats
    ) -> Failure:
        """Ranks silent past their limit. Collective training: every rank's stacks, and the whole group
        goes (the others wait in collectives); a replacing engine: the one rank's."""
        seen, one = time.time(), self.engine.replaces_workers
        silent = max(beats.silent_s(r) for r in hung)
        steps = sorted({str(progress[r].get("step")) for r in hung})
        folder = write_stacks(self.run_dir, attempt.number, group.stacks(hung[:1] if one else None))
        mute = group.silent(longer_than_s=min(self._limit(progress[r]) for r in hung))
        who = group.who(hung[0]) if one else f"rank{'s' * (len(hung) > 1)} {', '.join(map(str, hung))}"
        cause = (
            f"{who} made no progress for {silent:.1f} s (at step {', '.join(steps)})"
            + (f", rank {', '.join(map(str, mute))} not answering" if mute and not one else "")
            + f"; stacks in {folder}"
        )
        if all(progress[r].get("phase") == Phase.JOIN for r in hung):  # the rendezvous timed out, as we saw it
            cause = joining(group, cause)
            return Failure(FailureKind.HUNG, cause, hung[0] if one else None, signature=JOINING, joining=True, at=seen)
        return Failure(FailureKind.HUNG, cause, hung[0] if one else None, at=seen)


def joining(group: WorkerGroup, cause: str) -> str:
    """A failure while the ranks joined their process group, with where they met: what the user must check."""
    return f"{cause} (joining the process group: {group.network()})"
