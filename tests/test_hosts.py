"""Real hosts: Ray nodes in network namespaces, each with its own address and interface name
(distrain/testing/hosts.py), jobs sent with `ray job submit` from the head's namespace. What differs between
real hosts shows here and nowhere else: the interface gloo binds to, the rendezvous across hosts, the
environment each worker gets, and a host lost with every process on it.

Each host has 1 CPU and each worker 0.5, so 4 workers are 2 per host, and one host holds 2.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    TINY,
    assert_logged_as,
    attempt_placement,
    committed_step,
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


def submit(bed: Bed, job: str, args: list[str], wait: bool = True, runtime_env: dict | None = None) -> None:
    cmd = ["ray", "job", "submit", f"--submission-id={job}", f"--working-dir={REPO}"]
    cmd += ["--no-wait"] * (not wait) + [f"--runtime-env-json={json.dumps(runtime_env)}"] * bool(runtime_env)
    bed.client(*cmd, "--", "python", "jobs/train.py", *args, timeout=300, check=False)


def status(bed: Bed, job: str) -> str:
    out = bed.client("ray", "job", "status", job, check=False)
    return out.stdout + out.stderr


def explain(bed: Bed, job: str, run_dir: Path) -> str:
    """What a failed check needs: the job's status and log tail, and the run's attempts."""
    logs = bed.client("ray", "job", "logs", job, check=False).stdout.splitlines()[-40:]
    summary = run_dir / "summary.json"
    attempts = json.loads(summary.read_text()).get("attempts") if summary.exists() else "no summary.json"
    return "\n".join([status(bed, job), json.dumps(attempts, indent=1)[-4000:], *logs])


def assert_losses(run_dir: Path, want: dict[int, float], tol: float) -> None:
    got = {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=tol, abs=tol), f"loss at step {step}"


def wait_for(what: str, predicate, timeout_s: float = 180.0, context=lambda: ""):
    """predicate()'s first true value; past timeout_s, a failure saying what was awaited and context()."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what}\n{context()}"
        time.sleep(0.2)
    return value


@pytest.mark.timeout(300)
def test_ddp_across_two_hosts_trains_as_one_process(bed, one_worker, tmp_path: Path):
    submit(bed, "ddp", overrides(tmp_path, "ddp", "cluster.num_workers=4"))
    run_dir = tmp_path / "ddp"
    assert "succeeded" in status(bed, "ddp"), explain(bed, "ddp", run_dir)
    table = attempt_placement(run_dir)
    assert sorted(e["node_ip"] for e in table) == [h.address for h in bed.hosts for _ in range(2)]
    # Each worker found its own host's interface (their names differ) for gloo.
    interfaces = {h.address: h.interface for h in bed.hosts}
    assert all(e["interface"] == interfaces[e["node_ip"]] for e in table), table
    assert_losses(run_dir, one_worker, SAME_DATA)


@pytest.mark.timeout(300)
def test_tensor_parallel_stays_inside_a_host_and_data_parallel_spans_them(bed, one_worker, tmp_path: Path):
    submit(bed, "dp_tp", overrides(tmp_path, "dp_tp", "cluster.num_workers=4", "strategy=tp"))
    run_dir = tmp_path / "dp_tp"
    assert "succeeded" in status(bed, "dp_tp"), explain(bed, "dp_tp", run_dir)
    table = attempt_placement(run_dir)
    # The mesh is dp × tp, tp innermost: ranks 2k and 2k+1 are a TP group, ranks k and k+2 a DP group.
    assert [table[r]["node_ip"] == table[r + 1]["node_ip"] for r in (0, 2)] == [True, True]
    assert {table[0]["node_ip"], table[2]["node_ip"]} == {h.address for h in bed.hosts}
    assert_losses(run_dir, one_worker, RESHARDED)


@pytest.mark.timeout(300)
def test_parameter_servers_one_per_host(bed, one_worker, tmp_path: Path):
    """Synchronous parameter-server training is DDP's (tests/test_ps.py), across hosts too."""
    args = ["strategy=ps", "ps.num_servers=2", "cluster.num_workers=2", "cluster.placement_strategy=SPREAD"]
    submit(bed, "ps", overrides(tmp_path, "ps", *args))
    run_dir = tmp_path / "ps"
    assert "succeeded" in status(bed, "ps"), explain(bed, "ps", run_dir)
    table = attempt_placement(run_dir)
    servers = [e["node_ip"] for e in table if "server" in e]
    assert sorted(servers) == [h.address for h in bed.hosts]
    assert_losses(run_dir, one_worker, SAME_DATA)


@pytest.mark.timeout(300)
def test_ranks_that_cannot_reach_each_other_end_the_run_at_the_first_repeat_naming_the_addresses(bed, tmp_path: Path):
    """gloo told to use loopback, as it does by itself where the host name resolves to 127.0.x.x: ranks on
    different hosts can never connect. The second failure to form the group ends the run (not the failure
    budget, 5 here), in one line naming the rendezvous and each host's address and interface."""
    run_dir = tmp_path / "unreachable"
    bad = ["+cluster.env_vars.GLOO_SOCKET_IFNAME=lo", "cluster.max_failures=5", "cluster.restart_backoff_s=0"]
    timeouts = ["cluster.setup_timeout_s=15", "cluster.collective_timeout_s=15"]  # a failed rendezvous: 15 s
    submit(bed, "unreachable", overrides(tmp_path, "unreachable", "cluster.num_workers=4", *bad, *timeouts))
    assert "failed" in status(bed, "unreachable"), explain(bed, "unreachable", run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    # gloo's connect times out as the supervisor's hang limit for joining runs out: either may be seen first.
    assert len(summary["attempts"]) == 2 and {a["outcome"] for a in summary["attempts"]} <= {"failed", "hung"}
    line = summary["error"].splitlines()[0]
    assert "could not form their process group, twice the same way" in line, line
    assert all(f"{h.address} via lo" in line for h in bed.hosts), line
    assert "GLOO_SOCKET_IFNAME" in line.split("could not form")[1]  # the advice


@pytest.mark.timeout(400)
def test_ray_job_stop_across_hosts_checkpoints_and_a_resubmission_resumes(bed, ray_cluster, tmp_path: Path):
    """Stopped at whatever step the stop finds it, resumed 3 steps further: every loss, before the stop and
    after the resume, is a one-process run's of the same steps (the schedule's length is fixed, so that
    the resubmission's trainer.max_steps leaves it as it was)."""
    run_dir = tmp_path / "stopped"
    schedule = ("trainer.max_steps=5000", "checkpoint.interval=0", "optim.decay_steps=5000")
    args = overrides(tmp_path, "stopped", "cluster.num_workers=4", *schedule)
    submit(bed, "stop", args, wait=False, runtime_env={"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}})
    wait_for("5 steps", lambda: logged_step(run_dir) >= 5)
    bed.client("ray", "job", "stop", "stop", timeout=120, check=False)
    assert "was stopped" in status(bed, "stop"), explain(bed, "stop", run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    step = summary["final_step"]
    assert summary["status"] == "stopped" and 5 <= step < 5000
    assert (run_dir / "checkpoints" / f"step_{step:08d}" / "COMMITTED").exists()

    more = [a for a in args if not a.startswith("trainer.max_steps=")] + [f"trainer.max_steps={step + 3}"]
    submit(bed, "resume", more)
    assert "succeeded" in status(bed, "resume"), explain(bed, "resume", run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_step"] == step + 3
    assert summary["resumed_from"].endswith(f"step_{step:08d}")
    assert logged_step(run_dir) == step + 3
    same = [a for a in more if not a.startswith(("run.storage=", "run.name=", "cluster.num_workers="))]
    one = make_config(tmp_path / "one", "run.name=one", "cluster.num_workers=1", *same)
    assert train(one)["status"] == "completed"
    # The stop lands anywhere, tens of steps in: the sums' order drifts the fp32 losses past SAME_DATA over that
    # many steps (CI: 1.1e-5 relative at step 58); a lost step or optimizer state moves them by 1e-2 or more.
    assert_losses(run_dir, logged(one), RESHARDED)


@pytest.mark.timeout(420)
def test_a_lost_host_costs_only_the_step_in_flight_when_the_other_holds_a_whole_replica(bed, ray_cluster, tmp_path):
    """HSDP over the two hosts: one replica (2 shards) on each. Every process of the second host is killed
    mid-run (the run held between two steps, not slowed, so that it is lost there; tests/test_peer_recovery.py
    kills inside a step on one host); a new host joins, and its two new workers take the lost ranks and their
    state from the first host's replica, over the network. No checkpoint is read: the run saves none before its
    end, so a restart from one would begin at step 0. Every logged loss and the final weights equal to the bit
    those of the same training without a failure. Runs before the lost-host tests below, and leaves the bed as
    they do."""
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
        bed.kill_host(lost)
        new = bed.add_host()
        hold.unlink()
        wait_for("the end", lambda: any(w in status(bed, "replicas") for w in ("succeeded", "failed")), 240, context)
    finally:
        hold.unlink(missing_ok=True)
    assert "succeeded" in status(bed, "replicas"), explain(bed, "replicas", run_dir)
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


@pytest.mark.timeout(480)
def test_a_lost_host_shrinks_the_run_and_a_new_host_grows_it_back(bed, one_worker, tmp_path: Path):
    """Every process of the second host is killed mid-run (raylet, workers, all): the run goes on from
    its last checkpoint on the 2 workers the head's host holds; a new host joins and the run grows back
    to 4 at a checkpoint. Runs last in this module: it leaves the bed with a different second host."""
    run_dir, hold = tmp_path / "lost", tmp_path / "hold"
    args = overrides(
        tmp_path,
        "lost",
        "cluster.num_workers=4",
        "cluster.min_workers=2",
        "cluster.placement_timeout_s=3",
        "cluster.restart_backoff_s=0",
        "cluster.node_check_s=1",
        f"fault.hold_file={hold}",  # while it exists, every rank waits before its next step
    )
    submit(bed, "lost", args, wait=False)
    context = lambda: explain(bed, "lost", run_dir)  # noqa: E731
    lost = next(h for h in bed.hosts[1:] if h.ray is not None)  # the second host (a later one if it was lost)
    try:
        wait_for("step 8", lambda: logged_step(run_dir) >= 8, context=context)
        hold.write_text("")  # from here on, each attempt waits at its first step until the test lets it go
        lost_step, lost_at, committed = logged_step(run_dir), time.time(), committed_step(run_dir)
        bed.kill_host(lost)
        wait_for("the shrunk attempt", lambda: attempt_placement(run_dir, 2), context=context)
        new = bed.add_host()
        grown = wait_for("the grown attempt", lambda: attempt_placement(run_dir, 3), context=context)
        hold.unlink()
        wait_for("the end", lambda: any(w in status(bed, "lost") for w in ("succeeded", "failed")), 120, context)
    finally:
        hold.unlink(missing_ok=True)
    assert "succeeded" in status(bed, "lost"), explain(bed, "lost", run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    attempts = summary["attempts"]
    assert [(a["world_size"], a["outcome"]) for a in attempts] == [(4, "failed"), (2, "resized"), (4, "completed")]
    assert summary["status"] == "completed" and summary["final_step"] == STEPS
    lost_ip = lost.address
    assert lost_ip in attempts[0]["cause"], attempts[0]["cause"]
    assert attempts[0]["timings"]["ended_at"] - lost_at < 30
    assert {e["node_ip"] for e in attempt_placement(run_dir, 2)} == {bed.head.address}
    assert {e["node_ip"] for e in grown} == {bed.head.address, new.address}
    resumed = attempts[1]["info"]["resumed_from_step"]
    # The newest checkpoint committed when the host went, or one committed a moment later (in the background).
    assert resumed % CHECKPOINT_EVERY == 0 and committed <= resumed <= lost_step, (committed, resumed, lost_step)
    assert_losses(run_dir, one_worker, RESHARDED)


@pytest.mark.timeout(480)
def test_on_an_object_store_a_lost_host_shrinks_the_run_which_resumes_from_the_store(bed, one_worker, tmp_path: Path):
    """Each host keeps the run only in its own cache (its Ray node's DISTRAIN_CACHE_DIR) and on the object store
    (SeaweedFS on the bed's bridge, reachable from every host): no folder is shared between them. A host is lost
    mid-run; the run goes on, on the head's 2 workers, from the newest checkpoint committed on the store, which
    holds files only the lost host's ranks wrote: the resume fetched them from the store."""
    from distrain.storage.checkpoint import writer_of
    from distrain.testing.seaweed import Seaweed
    from distrain.urls import mirror_dir

    other = next(h for h in bed.hosts[1:] if h.ray is not None)
    store = Seaweed(tmp_path / "seaweed", host=bed.service_address(), namespace=bed.bridge).start()
    hold = tmp_path / "hold"
    try:
        url = store.url("bed")
        args = [*TINY, f"run.storage={url}", "run.name=lost", *COMMON, "cluster.num_workers=4", "cluster.min_workers=2"]
        args += ["cluster.placement_timeout_s=3", "cluster.restart_backoff_s=0", "checkpoint.keep=100"]
        args += ["storage.sync_interval_s=1", f"fault.hold_file={hold}"]
        submit(bed, "store-lost", args, wait=False, runtime_env={"env_vars": store.env})
        mirrors = {h.address: mirror_dir(f"{url}/lost", h.cache_dir) for h in (bed.head, other)}
        run_dir = mirrors[bed.head.address]  # the driver's (the job runs on the head's host), and rank 0's after
        context = lambda: explain(bed, "store-lost", run_dir)  # noqa: E731
        wait_for("step 8", lambda: max(logged_step(m) for m in mirrors.values()) >= 8, context=context)
        hold.write_text("")
        before = {m: {p.name for p in (m / "checkpoints").glob("step_*")} for m in mirrors.values()}
        bed.kill_host(other)
        wait_for("the shrunk attempt", lambda: attempt_placement(run_dir, 2), context=context)
        hold.unlink()
        wait_for("the end", lambda: any(w in status(bed, "store-lost") for w in ("succeeded", "failed")), 120, context)
    finally:
        hold.unlink(missing_ok=True)
        store.stop()
    assert "succeeded" in status(bed, "store-lost"), explain(bed, "store-lost", run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    attempts = summary["attempts"]
    assert [(a["world_size"], a["outcome"]) for a in attempts] == [(4, "failed"), (2, "completed")]
    assert {e["node_ip"] for e in attempt_placement(run_dir, 1)} == {bed.head.address, other.address}

    def writers(mirror: Path, step: str) -> set[int]:
        return {w for p in (mirror / "checkpoints" / step).iterdir() if (w := writer_of(p.name)) is not None}

    # Before the loss, each host's cache held only what its own ranks wrote: ranks 0-1 on one, 2-3 on the other;
    # the step it resumed from now holds every rank's files on the head: the lost host's came from the store.
    resumed = f"step_{attempts[1]['info']['resumed_from_step']:08d}"
    assert writers(run_dir, resumed) == {0, 1, 2, 3}
    head_ranks = {e["rank"] for e in attempt_placement(run_dir, 1) if e["node_ip"] == bed.head.address}
    for address, mirror in mirrors.items():
        mine = head_ranks if address == bed.head.address else {0, 1, 2, 3} - head_ranks
        for step in before[mirror] - {resumed}:
            assert writers(mirror, step) <= mine, (address, step, writers(mirror, step))
    assert len(before[run_dir] - {resumed}) >= 1  # there was a step to look at
    assert_losses(run_dir, one_worker, RESHARDED)
