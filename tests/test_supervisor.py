"""The supervisor on its own, with plain functions for ranks (no model, no torch.distributed): the
state machine's transition table, the policy's decisions, hang detection with stacks, reuse of
healthy workers, hot spares, replacing one worker while the others go on, fail-fast on a repeated
error, the budget, stop requests, and groups kept warm between runs."""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import ray.cloudpickle

from distrain.channel import Phase, Progress
from distrain.cluster.attempt import Attempt, Failure, FailureKind, Heartbeats, Outcome
from distrain.cluster.placement import GroupSpec, WorkerFailure
from distrain.cluster.policy import Decision, DefaultPolicy, FailurePolicy, Verdict, policy_class
from distrain.cluster.states import (
    TRANSITIONS,
    Failed,
    Finished,
    InvalidTransition,
    Placing,
    Recovering,
    Rejoining,
    Resizing,
    Running,
    Stopping,
    Work,
    check_transition,
)
from distrain.cluster.supervisor import Supervisor
from distrain.cluster.timeouts import Timeouts
from distrain.config import ClusterConfig

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

FAST = Timeouts(hang_timeout_s=2.0, setup_timeout_s=30.0, restart_backoff_s=0.0, poll_s=0.1)


def default(max_failures: int = 3) -> DefaultPolicy:
    return DefaultPolicy(ClusterConfig(max_failures=max_failures))


class Steps:
    """An engine whose ranks run a plain function: fn(attempt number, folder, channel)."""

    def __init__(self, fn, folder: Path, replaces_workers: bool = False, replicas: bool = False):
        """`replicas`: after a failure, say the kept workers hold the state (recovery from replicas)."""
        self.fn, self.folder, self.replaces_workers, self.replicas = fn, str(folder), replaces_workers, replicas

    def from_replicas(self, group) -> tuple[bool, str]:
        return self.replicas, "from the kept workers' memory" if self.replicas else ""

    def warm_up(self):
        return _nothing, ()

    def begin(self, group, attempt: Attempt) -> Work:
        return Work(self.fn, (attempt.number, self.folder))

    def tick(self, suspect: bool) -> None:
        pass

    def replaced(self, rank: int) -> None:
        pass

    def request_stop(self, deadline: float) -> None:
        pass

    def finish(self, results: list) -> dict:
        return {"ranks": results, "stopped": any(r.get("stopped") for r in results)}

    def end(self, keep: bool = False) -> None:
        pass


def _nothing() -> None:
    pass


def supervisor(tmp_path: Path, fn, n: int = 3, policy: FailurePolicy | None = None, **options) -> Supervisor:
    spares, replaces, reuse = options.get("spares", 0), options.get("replaces", False), options.get("reuse", False)
    spec = GroupSpec(num_workers=n, cpus_per_worker=0.25, gpus_per_worker=0, threads_per_worker=1, spares=spares)
    engine, timeouts = Steps(fn, tmp_path, replaces, options.get("replicas", False)), options.get("timeouts", FAST)
    on_progress = options.get("on_progress", lambda progress: None)
    return Supervisor(spec, policy or default(), timeouts, engine, [n], tmp_path, on_progress, reuse_workers=reuse)


def steps(attempt: int, folder: str, channel, until: int = 6, stall=lambda rank, step: None) -> dict:
    rank = int(os.environ["RANK"])
    for step in range(1, until + 1):
        channel.report(phase=Phase.TRAIN, step=step)
        stall(rank, step)
        time.sleep(0.05)
    return {"rank": rank, "attempt": attempt, "pid": os.getpid()}


# -- the state machine and the policy, without Ray --------------------------------------------------


def sample_states() -> dict[type, object]:
    attempt = Attempt(1, 2, {}, {"placed_at": 0.0})
    beats = Heartbeats(2, [])
    running = Running(attempt, beats)
    return {
        Placing: Placing(since=0.0),
        Rejoining: Rejoining(since=0.0),
        Running: running,
        Stopping: Stopping(attempt, beats, deadline=1.0),
        Resizing: Resizing(attempt, beats, why="draining"),
        Recovering: Recovering(running, [Failure(FailureKind.DIED, "rank 0 died", 0)]),
        Finished: Finished({}, stopped=False),
        Failed: Failed(RuntimeError("x")),
    }


@pytest.mark.parametrize(("old", "new"), list(itertools.product(sample_states(), repeat=2)), ids=lambda t: t.__name__)
def test_every_transition_is_allowed_or_raises_as_the_table_says(old: type, new: type):
    states = sample_states()
    if new in TRANSITIONS[old]:
        check_transition(states[old], states[new])
    else:
        with pytest.raises(InvalidTransition, match=f"{old.__name__} → {new.__name__}"):
            check_transition(states[old], states[new])


def test_the_table_has_the_runs_paths_and_final_states_lead_nowhere():
    assert TRANSITIONS[Finished] == TRANSITIONS[Failed] == set()
    for path in [
        (Placing, Running, Finished),  # a run that completes
        (Placing, Running, Recovering, Placing, Running, Finished),  # a restart
        (Placing, Running, Recovering, Rejoining, Running, Finished),  # a restart from the live replicas
        (Placing, Running, Recovering, Running, Finished),  # one worker replaced
        (Placing, Running, Resizing, Placing, Running, Finished),  # a drain or growing back
        (Placing, Running, Stopping, Finished),  # SIGTERM
    ]:
        assert all(b in TRANSITIONS[a] for a, b in zip(path, path[1:], strict=False)), path


def failure(kind: FailureKind, rank: int | None = 0, signature: tuple | None = None) -> Failure:
    return Failure(kind, f"{kind} of rank {rank}", rank, "Traceback ...", signature)


@pytest.mark.parametrize(
    ("kind", "rank", "replaces", "decision"),
    [
        (FailureKind.DIED, 0, False, Decision.RESTART),  # a process group restarts together
        (FailureKind.RAISED, 1, False, Decision.RESTART),
        (FailureKind.HUNG, None, False, Decision.RESTART),
        (FailureKind.DIED, 0, True, Decision.REPLACE),  # a parameter server's worker is replaced alone
        (FailureKind.RAISED, 2, True, Decision.REPLACE),
        (FailureKind.HUNG, 1, True, Decision.REPLACE),
        (FailureKind.LOST, None, True, Decision.RESTART),  # a lost server: only a restore helps
    ],
)
def test_the_policy_decides_by_the_failure_and_the_engine(kind, rank, replaces, decision):
    assert default().decide(failure(kind, rank), [], replaces).decision == decision


def test_the_policy_gives_up_on_the_budget_and_on_the_same_error_twice():
    policy = default(max_failures=2)
    died = failure(FailureKind.DIED)
    assert policy.decide(died, [died], False).decision == Decision.RESTART
    verdict = policy.decide(died, [died, died], False)
    assert verdict.decision == Decision.GIVE_UP and "failure 3, over cluster.max_failures=2" in verdict.reason
    assert default(max_failures=-1).decide(died, [died] * 50, False).decision == Decision.RESTART
    bug = failure(FailureKind.RAISED, signature=("ValueError", "bad batch", 3))
    assert default(max_failures=10).decide(bug, [bug], True).decision == Decision.GIVE_UP
    other_step = failure(FailureKind.RAISED, signature=("ValueError", "bad batch", 4))
    assert default(max_failures=10).decide(bug, [other_step], True).decision == Decision.REPLACE
    assert policy.size(4, [2]).size == 2 and policy.size(4, []).decision == Decision.GIVE_UP


def test_the_policy_gives_up_at_once_on_a_permanent_error_and_on_a_group_that_cannot_form_twice():
    refused = Failure(FailureKind.RAISED, "rank 0 failed: UnsafeCheckpointError: refused", 0, "...", permanent=True)
    assert default(max_failures=10).decide(refused, [], False) == Verdict(Decision.GIVE_UP, refused.cause)
    joining = Failure(FailureKind.RAISED, "rank 1 failed: DistNetworkError (joining: 10.0.0.1 via eth0)", 1, "...")
    joining = replace(joining, signature=("DistNetworkError",), joining=True)
    assert default().decide(joining, [], False).decision == Decision.RESTART  # the first time may be bad luck
    verdict = default(max_failures=10).decide(joining, [joining], False)
    assert verdict.decision == Decision.GIVE_UP
    assert "could not form their process group" in verdict.reason and "10.0.0.1 via eth0" in verdict.reason
    assert "GLOO_SOCKET_IFNAME" in verdict.reason and "\n" not in verdict.reason


def test_backoff_grows_only_while_attempts_make_no_progress():
    timeouts = Timeouts(restart_backoff_s=1.0)
    assert timeouts.backoff([10]) == 0.0 and timeouts.backoff([10, 20]) == 0.0  # each got further: at once
    assert [timeouts.backoff([10, 20] + [15] * k) for k in (1, 2, 3)] == [1.0, 2.0, 4.0]  # stuck: doubling


def test_a_policy_is_chosen_by_its_name_or_the_dotted_path_of_a_class():
    assert policy_class("default") is DefaultPolicy
    assert policy_class(f"{__name__}.RestartForRankOne") is RestartForRankOne  # defined below, outside distrain


# -- with Ray: each test below asks for the session's cluster (those above need none) --------------------------


def sleepy_rank(attempt: int, folder: str, channel) -> dict:
    def stall(rank: int, step: int) -> None:
        if attempt == 1 and rank == 1 and step == 3:
            Path(folder, "stalled_at").write_text(str(time.time()))
            time.sleep(600)  # "hangs" inside step 3: alive, answering, making no progress

    return steps(attempt, folder, channel, stall=stall)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(120)
def test_a_rank_that_stops_progressing_is_detected_with_stacks_and_the_run_recovers(tmp_path: Path):
    sup = supervisor(tmp_path, sleepy_rank)
    results = sup.run().results["ranks"]
    assert [r["attempt"] for r in results] == [2, 2, 2]
    first, second = sup.history.attempts
    assert (first.outcome, second.outcome) == (Outcome.HUNG, Outcome.COMPLETED)
    assert "rank 1 made no progress" in first.cause and "step 3" in first.cause
    # Detected once hang_timeout_s had passed without progress, and not long after.
    silent = first.timings["ended_at"] - float((tmp_path / "stalled_at").read_text())
    assert FAST.hang_timeout_s <= silent < FAST.hang_timeout_s + 2.0, silent
    stacks = sorted((tmp_path / "attempts" / "001-stacks").iterdir())
    assert [p.name for p in stacks] == ["rank_00000.txt", "rank_00001.txt", "rank_00002.txt"]
    hung = stacks[1].read_text()
    assert "in stall" in hung and "time.sleep(600)" in hung  # where rank 1 was stuck, line and all
    assert "in sleepy_rank" not in stacks[0].read_text()  # rank 0 had returned: no rank function running
    # A hung group is replaced whole: its ranks may be stuck in collectives, not reusable.
    assert not {r["pid"] for r in results} & {e["pid"] for e in _placement(tmp_path, 1)}


def dies_once(attempt: int, folder: str, channel) -> dict:
    def stall(rank: int, step: int) -> None:
        if attempt == 1 and rank == 1 and step == 2:
            os._exit(1)

    return steps(attempt, folder, channel, stall=stall)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("replicas", [False, True], ids=["from the checkpoint", "from the live replicas"])
def test_healthy_workers_are_kept_under_their_ranks_and_only_the_dead_one_is_replaced(tmp_path: Path, replicas):
    sup = supervisor(tmp_path, dies_once, replicas=replicas)
    states = []
    enter = sup._enter
    # a state stepped again without change (Running while no failure is seen yet) is entered anew: count one
    sup._enter = lambda state: (state is sup.state or states.append(type(state)), enter(state))
    results = sup.run().results["ranks"]
    first, second = sup.history.attempts
    assert first.outcome == Outcome.FAILED and "rank 1" in first.cause and "ActorDiedError" in first.cause
    before, after = _placement(tmp_path, 1), _placement(tmp_path, 2)
    dead = before[1]["pid"]
    # The survivors, warm, under the ranks they had: a process whose rank changed would find its new device
    # mesh resolving to its old groups' names (torch's caches), and it holds its own rank's state.
    assert [before[r]["pid"] for r in (0, 2)] == [after[r]["pid"] for r in (0, 2)]
    assert dead not in {r["pid"] for r in results} and len({r["pid"] for r in results}) == 3
    assert {"teardown_s", "placement_s"} <= set(second.record()["recovery"])
    assert states[:3] == [Running, Recovering, Rejoining if replicas else Placing]


def dies_then_waits(attempt: int, folder: str, channel) -> dict:
    """Every rank steps until a file says otherwise: in attempt 1, `die` kills rank 2; in attempt 2,
    `release` ends the run."""
    rank, step = int(os.environ["RANK"]), 0
    while not Path(folder, "release" if attempt > 1 else "never").exists():
        if attempt == 1 and rank == 2 and Path(folder, "die").exists():
            os._exit(1)
        step += 1
        channel.report(phase=Phase.TRAIN, step=step)
        time.sleep(0.05)
    return {"rank": rank, "attempt": attempt, "pid": os.getpid()}


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(120)
def test_a_hot_spare_takes_the_dead_rank_and_a_new_spare_is_started(tmp_path: Path):
    sup = supervisor(tmp_path, dies_then_waits, spares=1)
    finished = []
    runner = threading.Thread(target=lambda: finished.append(sup.run()))
    runner.start()

    def new_spares() -> list[dict]:  # warm spares that were no worker of the first attempt
        first = (tmp_path / "attempts" / "001-placement.json").exists() and {e["pid"] for e in _placement(tmp_path, 1)}
        group = sup.group
        return [e for e in (group.placement() if group else []) if "spare" in e and first and e["pid"] not in first]

    try:
        placed = tmp_path / "placement.json"  # the first spare is warm (listed there): rank 2 may die
        deadline = time.monotonic() + 90
        while not (placed.exists() and "spare" in placed.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        (tmp_path / "die").write_text("")
        while not (restocked := new_spares()) and runner.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        (tmp_path / "release").write_text("")
        runner.join(timeout=60)
    results = finished[0].results["ranks"]
    before, after = _placement(tmp_path, 1), _placement(tmp_path, 2)
    spare = [e for e in before if "spare" in e]
    assert len(spare) == 1 and "rank" not in spare[0]  # warm before the failure, holding no rank
    ranks_after = {e["pid"] for e in after if "rank" in e}
    assert spare[0]["pid"] in ranks_after  # the spare took the dead rank: no new process for it
    assert ranks_after == {r["pid"] for r in results} and before[2]["pid"] not in ranks_after
    # ... and a new spare was started in the bundle the dead worker left.
    assert len(restocked) == 1 and restocked[0]["pid"] not in ranks_after, (restocked, len(sup.history.attempts))


def dies_the_first_time(attempt: int, folder: str, channel) -> dict:
    def stall(rank: int, step: int) -> None:
        marker = Path(folder, "died")
        if rank == 2 and step == 2 and not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)

    return steps(attempt, folder, channel, until=20, stall=stall)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(120)
def test_an_engine_that_replaces_workers_keeps_the_others_going(tmp_path: Path):
    sup = supervisor(tmp_path, dies_the_first_time, replaces=True)
    ranks = sup.run().results["ranks"]
    assert len(sup.history.attempts) == 1 and sup.history.attempts[0].outcome == Outcome.COMPLETED  # never restarted
    (replacement,) = sup.history.replacements
    assert replacement["worker"] == 2 and "ActorDiedError" in replacement["cause"] and sup.history.restarts == 1
    first = _placement(tmp_path, 1)  # rewritten with the replacement in rank 2's place
    dead = int((tmp_path / "died").read_text())
    assert [r["pid"] for r in ranks] == [e["pid"] for e in first if "rank" in e] and dead not in [
        r["pid"] for r in ranks
    ]


class RestartForRankOne(FailurePolicy):
    """A new attempt for rank 1's failures, a replacement for any other rank's."""

    def decide(self, failure: Failure, earlier, replaces_workers: bool) -> Verdict:
        return Verdict(Decision.RESTART if failure.rank == 1 else Decision.REPLACE)


def ranks_1_and_2_raise(attempt: int, folder: str, channel) -> dict:
    """In attempt 1, ranks 1 and 2 raise once the supervisor is held between two looks (`held`)."""
    rank = int(os.environ["RANK"])
    if attempt == 1 and rank in (1, 2):
        while not Path(folder, "held").exists():
            time.sleep(0.01)
        Path(folder, f"raising_{rank}").write_text("")
        raise RuntimeError(f"rank {rank} fails")
    return steps(attempt, folder, channel)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(120)
def test_failures_seen_together_get_the_strongest_verdict(tmp_path: Path):
    """Ranks 1 and 2 fail in one look; the policy says RESTART for rank 1, REPLACE for rank 2: the group
    restarts (replacing both would ignore the RESTART)."""

    def hold_once(progress: Progress) -> None:
        if not (held := tmp_path / "held").exists():
            held.write_text("")
            while not all((tmp_path / f"raising_{r}").exists() for r in (1, 2)):
                time.sleep(0.01)
            time.sleep(1.0)  # both errors reach Ray: the next look sees them together

    policy = RestartForRankOne(ClusterConfig())
    sup = supervisor(tmp_path, ranks_1_and_2_raise, policy=policy, replaces=True, on_progress=hold_once)
    assert [r["attempt"] for r in sup.run().results["ranks"]] == [2, 2, 2]
    assert [f.rank for f in sup.history.failures] == [1, 2] and sup.history.replacements == []
    assert "rank 1" in sup.history.attempts[0].cause  # the failure whose verdict was carried out


def same_bug_every_time(attempt: int, folder: str, channel) -> dict:
    def stall(rank: int, step: int) -> None:
        if rank == 0 and step == 3:
            raise ValueError("bad batch")

    return steps(attempt, folder, channel, stall=stall)


class ShrinksOnFailure(FailurePolicy):
    """A mistaken policy: SHRINK is the answer to a group that cannot be placed (`size`), not to a failure."""

    def decide(self, failure: Failure, earlier, replaces_workers: bool) -> Verdict:
        return Verdict(Decision.SHRINK, size=1)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(120)
def test_a_verdict_decide_cannot_give_is_refused_not_taken_for_a_restart(tmp_path: Path):
    sup = supervisor(tmp_path, same_bug_every_time, policy=ShrinksOnFailure(ClusterConfig()))
    with pytest.raises(TypeError, match="ShrinksOnFailure.decide returned .*SHRINK.*: RESTART, REPLACE or GIVE_UP"):
        sup.run()
    assert len(sup.history.attempts) == 1


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(120)
def test_the_same_error_at_the_same_step_twice_fails_fast_with_its_traceback(tmp_path: Path):
    sup = supervisor(tmp_path, same_bug_every_time, policy=default(max_failures=10))
    with pytest.raises(WorkerFailure, match="same error at the same step twice") as info:
        sup.run()
    assert len(sup.history.attempts) == 2  # not the ten the budget allows
    message = str(info.value)
    assert "ValueError: bad batch" in message and 'raise ValueError("bad batch")' in message  # the traceback
    assert isinstance(sup.state, Failed)


def dies_at_a_new_step_each_time(attempt: int, folder: str, channel) -> dict:
    def stall(rank: int, step: int) -> None:
        if rank == 0 and step == attempt:
            os._exit(1)

    return steps(attempt, folder, channel, stall=stall)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(120)
def test_the_failure_budget_ends_the_run(tmp_path: Path):
    sup = supervisor(tmp_path, dies_at_a_new_step_each_time, policy=default(max_failures=2))
    with pytest.raises(WorkerFailure, match="failure 3, over cluster.max_failures=2"):
        sup.run()
    assert [a.outcome for a in sup.history.attempts] == [Outcome.FAILED] * 3


def until_stopped(attempt: int, folder: str, channel) -> dict:
    step = 0
    while channel.stop_deadline is None:
        step += 1
        channel.report(phase=Phase.TRAIN, step=step)
        time.sleep(0.05)
    return {"stopped": True, "step": step, "deadline": channel.stop_deadline}


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(60)
def test_a_stop_request_reaches_every_rank_with_a_deadline(tmp_path: Path):
    """Once a step is made (before it there is nothing to save: the attempt ends at once)."""

    def stop_after_a_step(progress: Progress) -> None:
        if progress.step:
            sup.request_stop()

    sup = supervisor(tmp_path, until_stopped, timeouts=replace(FAST, stop_grace_s=7.0), on_progress=stop_after_a_step)
    finished = sup.run()
    assert [a.outcome for a in sup.history.attempts] == [Outcome.STOPPED] and finished.stopped
    deadlines = {r["deadline"] for r in finished.results["ranks"]}
    assert deadlines == {sup.stop_requested_at + 6.0}  # exactly: a second of the grace kept for the driver


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(60)
def test_a_finished_runs_group_is_kept_warm_for_the_next_run_of_the_same_shape(tmp_path: Path):
    first = supervisor(tmp_path / "a", steps, n=2, reuse=True)
    pids = {r["pid"] for r in first.run().results["ranks"]}
    second = supervisor(tmp_path / "b", steps, n=2, reuse=True)
    assert {r["pid"] for r in second.run().results["ranks"]} == pids  # the same processes, no start
    third = supervisor(tmp_path / "c", steps, n=3)  # another shape: new workers
    assert not {r["pid"] for r in third.run().results["ranks"]} & pids


def _placement(run_dir: Path, attempt: int) -> list[dict]:
    return json.loads((run_dir / "attempts" / f"{attempt:03d}-placement.json").read_text())
