"""The supervisor on its own, with plain functions for ranks (no model, no torch.distributed):
hang detection with stacks, reuse of healthy workers, fail-fast on a repeated error, the budget."""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import ray.cloudpickle

from distrain.cluster.attempt import Attempt
from distrain.cluster.placement import GroupSpec, WorkerFailure
from distrain.cluster.policy import Policy
from distrain.cluster.supervisor import Supervisor

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

pytestmark = pytest.mark.usefixtures("ray_cluster")
FAST = Policy(max_failures=3, hang_timeout_s=2.0, setup_timeout_s=30.0, restart_backoff_s=0.0, poll_s=0.1)


def supervisor(tmp_path: Path, fn, n: int = 3, policy: Policy = FAST) -> Supervisor:
    spec = GroupSpec(num_workers=n, cpus_per_worker=0.25, gpus_per_worker=0, threads_per_worker=1)
    attempts = iter(range(1, 100))
    return Supervisor(spec, policy, fn, lambda world: ((next(attempts), str(tmp_path)), {}), [n], tmp_path)


def steps(attempt: int, folder: str, channel, until: int = 6, stall=lambda rank, step: None) -> dict:
    rank = int(os.environ["RANK"])
    for step in range(1, until + 1):
        channel.report({"phase": "train", "step": step})
        stall(rank, step)
        time.sleep(0.05)
    return {"rank": rank, "attempt": attempt, "pid": os.getpid()}


def sleepy_rank(attempt: int, folder: str, channel) -> dict:
    def stall(rank: int, step: int) -> None:
        if attempt == 1 and rank == 1 and step == 3:
            Path(folder, "stalled_at").write_text(str(time.time()))
            time.sleep(600)  # "hangs" inside step 3: alive, answering, making no progress

    return steps(attempt, folder, channel, stall=stall)


def test_a_rank_that_stops_progressing_is_detected_with_stacks_and_the_run_recovers(tmp_path: Path):
    sup = supervisor(tmp_path, sleepy_rank)
    results = sup.run()
    assert [r["attempt"] for r in results] == [2, 2, 2]
    first, second = sup.attempts
    assert (first.outcome, second.outcome) == ("hung", "completed")
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
        if attempt == 1 and rank == 2 and step == 2:
            os._exit(1)

    return steps(attempt, folder, channel, stall=stall)


def test_healthy_workers_are_kept_and_only_the_dead_one_is_replaced(tmp_path: Path):
    sup = supervisor(tmp_path, dies_once)
    results = sup.run()
    first, second = sup.attempts
    assert first.outcome == "failed" and "rank 2" in first.cause and "ActorDiedError" in first.cause
    before, after = _placement(tmp_path, 1), _placement(tmp_path, 2)
    dead = before[2]["pid"]
    assert {e["pid"] for e in before} - {dead} < {e["pid"] for e in after}  # the two survivors, warm
    assert dead not in {r["pid"] for r in results} and len({r["pid"] for r in results}) == 3
    assert {"teardown_s", "placement_s"} <= set(second.record()["recovery"])


def same_bug_every_time(attempt: int, folder: str, channel) -> dict:
    def stall(rank: int, step: int) -> None:
        if rank == 0 and step == 3:
            raise ValueError("bad batch")

    return steps(attempt, folder, channel, stall=stall)


def test_the_same_error_at_the_same_step_twice_fails_fast_with_its_traceback(tmp_path: Path):
    sup = supervisor(tmp_path, same_bug_every_time, policy=replace(FAST, max_failures=10))
    with pytest.raises(WorkerFailure, match="same error at the same step in two attempts") as info:
        sup.run()
    assert len(sup.attempts) == 2  # not the ten the budget allows
    message = str(info.value)
    assert "ValueError: bad batch" in message and 'raise ValueError("bad batch")' in message  # the traceback


def dies_at_a_new_step_each_time(attempt: int, folder: str, channel) -> dict:
    def stall(rank: int, step: int) -> None:
        if rank == 0 and step == attempt:
            os._exit(1)

    return steps(attempt, folder, channel, stall=stall)


def test_the_failure_budget_ends_the_run(tmp_path: Path):
    sup = supervisor(tmp_path, dies_at_a_new_step_each_time, policy=replace(FAST, max_failures=2))
    with pytest.raises(WorkerFailure, match="failure 3, over cluster.max_failures=2"):
        sup.run()
    assert [a.outcome for a in sup.attempts] == ["failed"] * 3


def until_stopped(attempt: int, folder: str, channel) -> dict:
    step = 0
    while channel.stop_deadline is None:
        step += 1
        channel.report({"phase": "train", "step": step})
        time.sleep(0.05)
    return {"stopped": True, "step": step, "deadline": channel.stop_deadline}


def test_a_stop_request_reaches_every_rank_with_a_deadline(tmp_path: Path):
    sup = supervisor(tmp_path, until_stopped, policy=replace(FAST, stop_grace_s=7.0))
    threading.Timer(2.0, sup.request_stop).start()
    results = sup.run()
    assert [a.outcome for a in sup.attempts] == ["stopped"]
    assert all(r["stopped"] for r in results)
    assert results[0]["deadline"] == pytest.approx(sup.stop_requested_at + 6.0)  # a second kept for the driver


def test_backoff_grows_only_while_attempts_make_no_progress():
    sup = supervisor(Path("."), steps, policy=Policy(restart_backoff_s=1.0))
    for reached in (10, 20):  # each attempt got further: retry at once
        sup.attempts.append(Attempt(len(sup.attempts) + 1, 3, {}, {}, step_reached=reached))
        assert sup._backoff() == 0.0
    for waits in (1.0, 2.0, 4.0):  # stuck below step 20: 1 s, then doubling
        sup.attempts.append(Attempt(len(sup.attempts) + 1, 3, {}, {}, step_reached=15))
        assert sup._backoff() == waits


def _placement(run_dir: Path, attempt: int) -> list[dict]:
    import json

    return json.loads((run_dir / "attempts" / f"{attempt:03d}-placement.json").read_text())
