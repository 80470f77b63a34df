"""Real hosts: Ray nodes in network namespaces, each with its own address and interface name
(distrain/testing/hosts.py), jobs sent with `ray job submit` from the head's namespace. What differs between
real hosts shows here and nowhere else: the interface gloo binds to, the rendezvous across hosts, the
environment each worker gets, and a host lost with every process on it.

Each host has 1 CPU and each worker 0.5, so 4 workers are 2 per host, and one host holds 2.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    REPO,
    TIMEOUT_SCALE,
    TINY,
    assert_logged_as,
    attempt_placement,
    final_weights,
    logged,
    logged_step,
    make_config,
)

from distrain.driver.launch import train
from distrain.testing.hosts import Bed, unavailable

pytestmark = pytest.mark.skipif(bool(reason := unavailable()), reason=reason or "")

STEPS = 24
CHECKPOINT_EVERY = 3
COMMON = (
    f"trainer.max_steps={STEPS}",
    f"checkpoint.interval={CHECKPOINT_EVERY}",
    "cluster.cpus_per_worker=0.5",
    "cluster.reuse_workers=false",
)
# Losses of the same global batch on 1, 2 or 4 workers differ only in the order of their sums (the
# all-reduce, 1 or 2 accumulated micro-batches): in fp32 by at most 5e-7 here. 1e-5 where only the data
# is split, as tests/test_training.py asks; 1e-4 where tensor parallelism also splits the matmuls
# (tests/test_strategies.py) or a run reshards between 4 and 2 workers (tests/test_elastic.py). A step
# lost or trained twice, a batch read from the wrong place or optimizer state lost in a reshard moves
# the loss by 1e-2 or more.
SAME_DATA, RESHARDED = 1e-5, 1e-4
# A run that is only compared with one process trains the first SHORT steps of the same 24-step schedule: each step
# of each is compared, and the start (the job, the workers, the rendezvous across hosts) is what takes the time.
SHORT = 8


@pytest.fixture(scope="module")
def bed():
    bed = Bed(cpus_per_host=1)
    try:
        bed.add_host()
        bed.add_host()
        yield bed
    finally:
        bed.close()


@pytest.fixture(scope="module")
def one_worker(ray_cluster, tmp_path_factory) -> dict[int, float]:
    """The losses of the same training in one process (the session's loopback cluster)."""
    cfg = make_config(tmp_path_factory.mktemp("one"), "run.name=one", "cluster.num_workers=1", *COMMON)
    assert train(cfg)["status"] == "completed"
    return logged(cfg)


def overrides(storage: Path, name: str, *more: str) -> list[str]:
    return [*TINY, f"run.storage={storage}", f"run.name={name}", *COMMON, *more]


def submit(bed: Bed, job: str, args: list[str], wait: bool = True, runtime_env: dict | None = None) -> str:
    """What `ray job submit` said: when it waits, the job's log, then how the job ended in `ray job status`'s
    words (the CLI asks the same, once the log ends)."""
    cmd = ["ray", "job", "submit", f"--submission-id={job}", f"--working-dir={REPO}"]
    cmd += ["--no-wait"] * (not wait) + [f"--runtime-env-json={json.dumps(runtime_env)}"] * bool(runtime_env)
    out = bed.client(*cmd, "--", "python", "jobs/train.py", *args, timeout=300, check=False)
    return out.stdout + out.stderr


def short(args: list[str]) -> list[str]:
    """`args` trained for SHORT steps of the same schedule (STEPS long)."""
    return [a for a in args if not a.startswith("trainer.max_steps=")] + [
        f"trainer.max_steps={SHORT}",
        f"optim.decay_steps={STEPS}",
    ]


def first(losses: dict[int, float], steps: int) -> dict[int, float]:
    return {step: loss for step, loss in losses.items() if step <= steps}


def status(bed: Bed, job: str) -> str:
    out = bed.client("ray", "job", "status", job, check=False)
    return out.stdout + out.stderr


def explain(bed: Bed, job: str, run_dir: Path) -> str:
    """What a failed check needs: the job's status and log tail, and the run's attempts."""
    logs = bed.client("ray", "job", "logs", job, check=False).stdout.splitlines()[-40:]
    summary = run_dir / "summary.json"
    attempts = json.loads(summary.read_text()).get("attempts") if summary.exists() else "no summary.json"
    return "\n".join([status(bed, job), json.dumps(attempts, indent=1)[-4000:], *logs])


def assert_losses(run_dir: Path, want: dict[int, float], tol: float, steps: int | None = None) -> None:
    """The run's losses are `want`'s, step for step (the first `steps` of each, if given)."""
    got = {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    if steps is not None:
        got, want = first(got, steps), first(want, steps)
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=tol, abs=tol), f"loss at step {step}"


def finish(bed: Bed, job: str, timeout_s: float, context=lambda: "") -> str:
    """How the job ended, in `ray job status`'s words: `ray job logs --follow` returns once it has, and says so (the
    CLI asks the job's status as the log ends). One client waiting, where a `ray job status` a look would start
    Python and Ray's CLI each time: seconds of CPU the run needs."""
    deadline, said = time.monotonic() + timeout_s, ""
    while not any(f"Job '{job}' {end}" in said for end in ("succeeded", "failed", "was stopped")):
        left = deadline - time.monotonic()
        assert left > 0, f"waited {timeout_s:g} s for the end of job {job}\n{context()}"
        try:
            out = bed.client("ray", "job", "logs", "--follow", job, timeout=left, check=False)
            said = out.stdout + out.stderr
        except subprocess.TimeoutExpired:
            pass  # said so above, with the context
    return said


def wait_for(what: str, predicate, timeout_s: float = 180.0, context=lambda: ""):
    """predicate()'s first true value; past timeout_s, a failure saying what was awaited and context()."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what}\n{context()}"
        time.sleep(0.2)
    return value


@pytest.fixture(scope="module")
def stopped(bed, ray_cluster, tmp_path_factory) -> SimpleNamespace:
    """DDP on 4 workers across both hosts (2 each), stopped with `ray job stop` at whatever step the stop finds it
    (5 or later) and resubmitted for 3 steps more; one process's losses of the same steps, on the same schedule
    (its length fixed, so that the resubmission's trainer.max_steps leaves it as it was). One run for two tests:
    the training across hosts (test_ddp_…) and the stop and resume (test_ray_job_stop_…)."""
    tmp_path = tmp_path_factory.mktemp("stopped")
    run_dir = tmp_path / "stopped"
    schedule = ("trainer.max_steps=5000", "checkpoint.interval=0", "optim.decay_steps=5000")
    args = overrides(tmp_path, "stopped", "cluster.num_workers=4", *schedule)
    submit(bed, "stop", args, wait=False, runtime_env={"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}})
    wait_for("5 steps", lambda: logged_step(run_dir) >= 5, context=lambda: explain(bed, "stop", run_dir))
    stopping = bed.client("ray", "job", "stop", "stop", timeout=120, check=False)  # waits for the end, says it
    run = SimpleNamespace(run_dir=run_dir, status=stopping.stdout + stopping.stderr, table=attempt_placement(run_dir))
    run.explain = lambda: explain(bed, "stop", run_dir)
    run.summary = json.loads((run_dir / "summary.json").read_text())
    step = run.step = run.summary["final_step"]

    more = [a for a in args if not a.startswith("trainer.max_steps=")] + [f"trainer.max_steps={step + 3}"]
    run.resumed_status, run.resumed_explain = submit(bed, "resume", more), lambda: explain(bed, "resume", run_dir)
    same = [a for a in more if not a.startswith(("run.storage=", "run.name=", "cluster.num_workers="))]
    one = make_config(tmp_path / "one", "run.name=one", "cluster.num_workers=1", *same)
    assert train(one)["status"] == "completed"
    run.one = logged(one)
    return run


@pytest.mark.timeout(300)
def test_ddp_across_two_hosts_trains_as_one_process(bed, stopped):
    """The stopped run's (the fixture): what each worker trained, before the stop and after the resume."""
    table = stopped.table
    assert sorted(e["node_ip"] for e in table) == [h.address for h in bed.hosts for _ in range(2)], stopped.explain()
    # Each worker found its own host's interface (their names differ) for gloo.
    interfaces = {h.address: h.interface for h in bed.hosts}
    assert all(e["interface"] == interfaces[e["node_ip"]] for e in table), table
    # The first STEPS steps as one process's; the drift of the sums' order past them: test_ray_job_stop_….
    assert_losses(stopped.run_dir, stopped.one, SAME_DATA, steps=STEPS)


@pytest.mark.timeout(300)
def test_tensor_parallel_stays_inside_a_host_and_data_parallel_spans_them(bed, one_worker, tmp_path: Path):
    said = submit(bed, "dp_tp", short(overrides(tmp_path, "dp_tp", "cluster.num_workers=4", "strategy=tp")))
    run_dir = tmp_path / "dp_tp"
    assert "Job 'dp_tp' succeeded" in said, explain(bed, "dp_tp", run_dir)
    table = attempt_placement(run_dir)
    # The mesh is dp × tp, tp innermost: ranks 2k and 2k+1 are a TP group, ranks k and k+2 a DP group.
    assert [table[r]["node_ip"] == table[r + 1]["node_ip"] for r in (0, 2)] == [True, True]
    assert {table[0]["node_ip"], table[2]["node_ip"]} == {h.address for h in bed.hosts}
    assert_losses(run_dir, first(one_worker, SHORT), RESHARDED)


@pytest.mark.timeout(300)
def test_parameter_servers_one_per_host(bed, one_worker, tmp_path: Path):
    """Synchronous parameter-server training is DDP's (tests/test_ps.py), across hosts too."""
    args = ["strategy=ps", "ps.num_servers=2", "cluster.num_workers=2", "cluster.placement_strategy=SPREAD"]
    said = submit(bed, "ps", short(overrides(tmp_path, "ps", *args)))
    run_dir = tmp_path / "ps"
    assert "Job 'ps' succeeded" in said, explain(bed, "ps", run_dir)
    table = attempt_placement(run_dir)
    servers = [e["node_ip"] for e in table if "server" in e]
    assert sorted(servers) == [h.address for h in bed.hosts]
    assert_losses(run_dir, first(one_worker, SHORT), SAME_DATA)


@pytest.mark.timeout(300)
def test_ranks_that_cannot_reach_each_other_end_the_run_at_the_first_repeat_naming_the_addresses(bed, tmp_path: Path):
    """gloo told to use loopback, as it does by itself where the host name resolves to 127.0.x.x: ranks on
    different hosts can never connect. The second failure in a row to form the group ends the run (not the failure
    budget, 6 here), in one line naming the rendezvous and each host's address and interface."""
    run_dir = tmp_path / "unreachable"
    bad = ["+cluster.env_vars.GLOO_SOCKET_IFNAME=lo", "cluster.max_failures=6", "cluster.restart_backoff_s=0"]
    # The second attempt's rendezvous fails when a rank has been silent this long (the first's fails at once, gloo's
    # connections refused). The same limit covers a fresh worker's start, its import of torch (2-3 s on 2 quiet
    # cores, over 8 s beside the suite's other stream at its busiest): an attempt that times out there is a hang in
    # start-up, not a failure to join, and the two failures to join the rule needs are then the next two.
    limit = 12 * TIMEOUT_SCALE
    timeouts = [f"cluster.setup_timeout_s={limit:g}", f"cluster.collective_timeout_s={limit:g}"]
    one_per_host = ["cluster.num_workers=2", "cluster.placement_strategy=SPREAD"]  # 2 fresh workers an attempt, not 4
    said = submit(bed, "unreachable", overrides(tmp_path, "unreachable", *one_per_host, *bad, *timeouts))
    assert "Job 'unreachable' failed" in said, explain(bed, "unreachable", run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    # gloo's connect times out as the supervisor's hang limit for joining runs out: either may be seen first.
    last_two = summary["attempts"][-2:]
    assert len(last_two) == 2 and {a["outcome"] for a in last_two} <= {"failed", "hung"}, summary["attempts"]
    assert all("joining the process group" in a["cause"] for a in last_two), summary["attempts"]
    line = summary["error"].splitlines()[0]
    assert "could not form their process group, twice the same way" in line, line
    assert all(f"{h.address} via lo" in line for h in bed.hosts), line
    assert "GLOO_SOCKET_IFNAME" in line.split("could not form")[1]  # the advice


@pytest.mark.timeout(400)
def test_ray_job_stop_across_hosts_checkpoints_and_a_resubmission_resumes(stopped):
    """Stopped at whatever step the stop finds it, resumed 3 steps further: every loss, before the stop and
    after the resume, is a one-process run's of the same steps (the fixture's run)."""
    run_dir, summary, step = stopped.run_dir, stopped.summary, stopped.step
    assert "Job 'stop' was stopped" in stopped.status, stopped.explain()
    assert summary["status"] == "stopped" and 5 <= step < 5000
    assert (run_dir / "checkpoints" / f"step_{step:08d}" / "COMMITTED").exists()

    assert "Job 'resume' succeeded" in stopped.resumed_status, stopped.resumed_explain()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_step"] == step + 3
    assert summary["resumed_from"].endswith(f"step_{step:08d}")
    assert logged_step(run_dir) == step + 3
    # The stop lands anywhere, tens of steps in: the sums' order drifts the fp32 losses past SAME_DATA over that
    # many steps (CI: 1.1e-5 relative at step 58); a lost step or optimizer state moves them by 1e-2 or more.
    assert_losses(run_dir, stopped.one, RESHARDED)


@pytest.mark.timeout(420)
def test_a_lost_host_costs_only_the_step_in_flight_when_the_other_holds_a_whole_replica(bed, ray_cluster, tmp_path):
    """HSDP over the two hosts: one replica (2 shards) on each. Every process of the second host is killed
    mid-run (the run held between two steps, not slowed, so that it is lost there; tests/test_peer_recovery.py
    kills inside a step on one host); a new host joins, and its two new workers take the lost ranks and their
    state from the first host's replica, over the network. No checkpoint is read: the run saves none before its
    end, so a restart from one would begin at step 0. Every logged loss and the final weights equal to the bit
    those of the same training without a failure. Runs before the lost-host run below, and leaves the bed as it
    does."""
    hsdp = ["strategy.zero=3", "strategy.dp_replicate=2", "strategy.dp_shard=2", "cluster.num_workers=4"]
    one_run = ["checkpoint.interval=0", "cluster.placement_timeout_s=120", "cluster.restart_backoff_s=0"]
    reference = make_config(tmp_path, "run.name=reference", *COMMON, *hsdp, *one_run)
    assert train(reference)["restarts"] == 0  # on the session's loopback cluster: the same arithmetic
    run_dir, hold = tmp_path / "replicas", tmp_path / "hold"
    held = [f"fault.hold_file={hold}"]  # while it exists, every rank waits before its next step
    submit(bed, "replicas", overrides(tmp_path, "replicas", *hsdp, *one_run, *held), wait=False)
    context = lambda: explain(bed, "replicas", run_dir)  # noqa: E731
    lost = next(h for h in bed.hosts[1:] if h.ray is not None)
    try:
        wait_for("step 8", lambda: logged_step(run_dir) >= 8, context=context)
        hold.write_text("")  # the host is lost between two steps, which the attempt after it must not redo
        # once every rank waits there: a survivor still inside a step's collectives when the host goes (a loaded
        # machine) is ended with the attempt, and its replica with it
        wait_for("every rank held", lambda: len(list(tmp_path.glob("hold.held.*"))) == 4, context=context)
        bed.kill_host(lost)
        new = bed.add_host()
        hold.unlink()
        said = finish(bed, "replicas", 240, context)
    finally:
        hold.unlink(missing_ok=True)
    assert "Job 'replicas' succeeded" in said, explain(bed, "replicas", run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    attempts = summary["attempts"]
    assert [(a["world_size"], a["outcome"]) for a in attempts] == [(4, "failed"), (4, "completed")], context()
    assert lost.address in attempts[0]["cause"]
    first, second = attempt_placement(run_dir, 1), attempt_placement(run_dir, 2)
    moved = [e["rank"] for e in first if e["node_ip"] == lost.address]
    assert {second[r]["node_ip"] for r in moved} == {new.address}  # the lost ranks, on the new host
    # Their state came from the other replica's memory: the step the failure found, with only it redone.
    assert attempts[1]["info"] == {"resumed_from": "replicas", "resumed_from_step": attempts[0]["step_reached"]}
    assert attempts[0]["step_reached"] >= 8 and summary["steps_executed"] <= STEPS + 1
    weights = final_weights(reference)
    got = final_weights(make_config(tmp_path, "run.name=replicas", *COMMON, *hsdp))
    assert [k for k in weights if not torch.equal(got[k], weights[k])] == []
    # The host died at a random moment: the line of the step resumed from may be unknowable (conftest).
    assert_logged_as(make_config(tmp_path, "run.name=replicas"), logged(reference), [attempts[0]["step_reached"]])


@pytest.fixture(scope="module")
def lost_host(bed, tmp_path_factory) -> SimpleNamespace:
    """A run on an object store (SeaweedFS on the bed's bridge, reachable from every host), each host keeping it only
    in its own cache (its Ray node's DISTRAIN_CACHE_DIR): no folder is shared between them. Every process of the
    second host is killed mid-run (raylet, workers, all): the run goes on from the newest checkpoint committed on the
    store, on the 2 workers the head's host holds; a new host joins and the run grows back to 4 at a checkpoint. One
    run for two tests: the shrink and the growth back (test_a_lost_host_…) and the resume from the store
    (test_on_an_object_store_…). Runs last in this module: it leaves the bed with a different second host."""
    from distrain.testing.seaweed import Seaweed
    from distrain.urls import mirror_dir

    tmp_path = tmp_path_factory.mktemp("lost")
    lost = next(h for h in bed.hosts[1:] if h.ray is not None)  # the second host (a later one if it was lost)
    store = Seaweed(tmp_path / "seaweed", host=bed.service_address(), namespace=bed.bridge).start()
    hold = tmp_path / "hold"
    run = SimpleNamespace(lost=lost)
    try:
        url = store.url("bed")
        args = [*TINY, f"run.storage={url}", "run.name=lost", *COMMON, "cluster.num_workers=4", "cluster.min_workers=2"]
        args += ["cluster.placement_timeout_s=3", "cluster.restart_backoff_s=0", "cluster.node_check_s=1"]
        args += ["checkpoint.keep=100", "storage.sync_interval_s=1", f"fault.hold_file={hold}"]
        submit(bed, "lost", args, wait=False, runtime_env={"env_vars": store.env})
        run.mirrors = mirrors = {h.address: mirror_dir(f"{url}/lost", h.cache_dir) for h in (bed.head, lost)}
        run.run_dir = run_dir = mirrors[bed.head.address]  # the driver's (the job runs on the head's host)
        run.explain = context = lambda: explain(bed, "lost", run_dir)  # noqa: E731
        wait_for("step 8", lambda: max(logged_step(m) for m in mirrors.values()) >= 8, context=context)
        hold.write_text("")  # from here on, each attempt waits at its first step until the test lets it go
        run.lost_step, run.lost_at, run.committed = max(logged_step(m) for m in mirrors.values()), time.time(), 0
        run.before = {m: {p.name for p in (m / "checkpoints").glob("step_*")} for m in mirrors.values()}
        # The newest checkpoint committed on the store: each rank marks its mirror's copy once it is.
        for marker in (run_dir / "checkpoints").glob("step_*/COMMITTED"):
            run.committed = max(run.committed, json.loads(marker.read_text())["step"])
        bed.kill_host(lost)
        run.shrunk = wait_for("the shrunk attempt", lambda: attempt_placement(run_dir, 2), context=context)
        run.new = bed.add_host()
        run.grown = wait_for("the grown attempt", lambda: attempt_placement(run_dir, 3), context=context)
        hold.unlink()
        run.status = finish(bed, "lost", 180, context)
    finally:
        hold.unlink(missing_ok=True)
        store.stop()
    run.summary = json.loads((run_dir / "summary.json").read_text())
    return run


@pytest.mark.timeout(480)
def test_a_lost_host_shrinks_the_run_and_a_new_host_grows_it_back(bed, lost_host, one_worker):
    """The lost host's run (the fixture): it failed at once, went on on the head's 2 workers from the newest
    checkpoint, grew back onto the new host at a checkpoint and finished with an uninterrupted run's losses."""
    run_dir, summary = lost_host.run_dir, lost_host.summary
    assert "Job 'lost' succeeded" in lost_host.status, lost_host.explain()
    attempts = summary["attempts"]
    assert [(a["world_size"], a["outcome"]) for a in attempts] == [(4, "failed"), (2, "resized"), (4, "completed")]
    assert summary["status"] == "completed" and summary["final_step"] == STEPS
    lost_ip = lost_host.lost.address
    assert lost_ip in attempts[0]["cause"], attempts[0]["cause"]
    assert attempts[0]["timings"]["ended_at"] - lost_host.lost_at < 30
    assert {e["node_ip"] for e in attempt_placement(run_dir, 1)} == {bed.head.address, lost_ip}
    assert {e["node_ip"] for e in lost_host.shrunk} == {bed.head.address}
    assert {e["node_ip"] for e in lost_host.grown} == {bed.head.address, lost_host.new.address}
    resumed, lost_step, committed = attempts[1]["info"]["resumed_from_step"], lost_host.lost_step, lost_host.committed
    # The newest checkpoint committed when the host went, or one committed a moment later (in the background).
    assert resumed % CHECKPOINT_EVERY == 0 and committed <= resumed <= lost_step, (committed, resumed, lost_step)
    assert attempts[2]["info"]["resumed_from_step"] == attempts[1]["step_reached"]  # grown at a checkpoint
    assert_losses(run_dir, one_worker, RESHARDED)


@pytest.mark.timeout(480)
def test_on_an_object_store_a_lost_host_shrinks_the_run_which_resumes_from_the_store(bed, lost_host):
    """The lost host's run (the fixture): the newest checkpoint committed on the store when the host went holds
    files only the lost host's ranks wrote, and the resume fetched them from the store."""
    from distrain.storage.checkpoint import writer_of

    run_dir, attempts = lost_host.run_dir, lost_host.summary["attempts"]
    assert "Job 'lost' succeeded" in lost_host.status, lost_host.explain()

    def writers(mirror: Path, step: str) -> set[int]:
        return {w for p in (mirror / "checkpoints" / step).iterdir() if (w := writer_of(p.name)) is not None}

    # Before the loss, each host's cache held only what its own ranks wrote: ranks 0-1 on one, 2-3 on the other;
    # the step it resumed from now holds every rank's files on the head: the lost host's came from the store.
    resumed = f"step_{attempts[1]['info']['resumed_from_step']:08d}"
    assert writers(run_dir, resumed) == {0, 1, 2, 3}
    head_ranks = {e["rank"] for e in attempt_placement(run_dir, 1) if e["node_ip"] == bed.head.address}
    for address, mirror in lost_host.mirrors.items():
        mine = head_ranks if address == bed.head.address else {0, 1, 2, 3} - head_ranks
        for step in lost_host.before[mirror] - {resumed}:
            assert writers(mirror, step) <= mine, (address, step, writers(mirror, step))
    assert len(lost_host.before[run_dir] - {resumed}) >= 1  # there was a step to look at
