"""The Ray layer on its own: placement order, torchrun environment, failure and progress reporting."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import ray
import ray.cloudpickle
from conftest import compose
from ray._private.state import state
from ray.util.placement_group import remove_placement_group

from distrain.cluster.placement import GroupSpec, PlacementError, WorkerFailure, number_nodes, rank_table
from distrain.cluster.places import WorkerPlace
from distrain.cluster.runtime import CapacityError, check_capacity
from distrain.cluster.worker_group import WorkerGroup
from distrain.driver.workers import worker_env

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

ENV_KEYS = (
    *("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"),
    *("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"),
)


def spec(n: int) -> GroupSpec:
    return GroupSpec(num_workers=n, cpus_per_worker=0.25, gpus_per_worker=0, threads_per_worker=1)


def test_rank_table_sorts_by_node_then_gpu():
    places = [
        WorkerPlace("b", "10.0.0.10", None, [1], pid=1, bundle=0),
        WorkerPlace("a", "10.0.0.9", None, [1], pid=2, bundle=1),
        WorkerPlace("b", "10.0.0.10", None, [0], pid=3, bundle=2),
        WorkerPlace("a", "10.0.0.9", None, [0], pid=4, bundle=3),
    ]
    table = rank_table(places)
    # 10.0.0.9 sorts before 10.0.0.10 as an address, not as a string.
    assert [e.pid for e in table] == [4, 2, 3, 1]
    assert [e.local_rank for e in table] == [0, 1, 0, 1]
    assert [e.node_rank for e in table] == [0, 0, 1, 1]
    assert all(e.local_world_size == 2 for e in table)


def test_a_replaced_rank_gets_the_local_rank_of_where_it_came_back():
    ips = {"a": "10.0.0.1", "b": "10.0.0.2"}
    on = (("a", 0), ("a", 1), ("b", 0), ("b", 1))
    table = rank_table([WorkerPlace(n, ips[n], None, [g], pid=i, bundle=i) for i, (n, g) in enumerate(on)])
    # Rank 0 died and its replacement started on node b's GPU 2; ranks keep their numbers.
    table[0] = table[0].moved_to(WorkerPlace("b", ips["b"], None, [2], pid=9, bundle=0))
    number_nodes(table)
    assert [e.rank for e in table] == [0, 1, 2, 3]
    assert [e.node_rank for e in table] == [0, 1, 0, 0]
    assert [e.local_rank for e in table] == [2, 0, 0, 1]  # GPU 2 is the third of node b's GPUs 0, 1, 2
    assert [e.local_world_size for e in table] == [3, 1, 3, 3]


def environment(channel):
    channel.report(step=1)
    return {k: os.environ[k] for k in ENV_KEYS}


def ids_of(group: WorkerGroup) -> list[str]:
    return [worker._actor_id.hex() for worker in group.workers]


def assert_killed(ids: list[str]) -> None:
    """Each actor ended by the group's kill (cluster/kill.py): none let go before the kill reached the GCS, which
    then ended it its own way, a graceful exit whose interpreter teardown could crash on the console."""
    causes = {i: str(state.actor_table(i)["DeathCause"]).replace("\n", " ") for i in ids}
    assert all("ray.kill" in cause for cause in causes.values()), causes


@pytest.mark.usefixtures("ray_cluster")
def test_workers_get_torchrun_environment_on_loopback():
    with WorkerGroup(spec(3)) as group:
        table = group.start()
        envs = group.run(environment)
        ids = ids_of(group)
    assert_killed(ids)
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"}
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {""}  # CPU workers see no GPU, even on a GPU machine
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert all(e.node_ip == "127.0.0.1" for e in table)


def network_environment(channel):
    return {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "MY_SETTING")}


@pytest.mark.usefixtures("ray_cluster")
def test_workers_get_their_nodes_interface_and_the_users_variables(monkeypatch):
    """Each worker is given the interface holding its node's address (loopback here: `lo`) for gloo and
    NCCL; the driver's NCCL_*, GLOO_*, TORCH_*, CUDA_* and WANDB_* variables and cluster.env_vars follow
    it to the workers, and a user's own interface choice wins."""
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # the driver's GPUs are not the workers'
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    cfg = compose(["+cluster.env_vars.MY_SETTING=on"])
    with WorkerGroup(replace(spec(2), env=worker_env(cfg.cluster))) as group:
        table = group.start()
        envs = group.run(network_environment)
        assert {e.interface for e in table} == {"lo"}
        want = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "INFO", "MY_SETTING": "on"}
        assert envs == [want, want]
        assert {e["CUDA_VISIBLE_DEVICES"] for e in group.run(environment)} == {""}
        group.spec = replace(group.spec, env=worker_env(compose(["+cluster.env_vars.GLOO_SOCKET_IFNAME=eth7"]).cluster))
        assert [e["GLOO_SOCKET_IFNAME"] for e in group.run(network_environment)] == ["eth7", "eth7"]
        ids = ids_of(group)
    assert_killed(ids)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(120)
def test_every_worker_of_an_ended_group_dies_by_its_kill():
    """Ray does not order the kill of an actor and the release of its handle: let go at once, most of a group's
    workers were ended the GCS's own way (a graceful exit) and a run's workers then crashed now and then tearing
    their interpreter down, on the console after the run. Three groups, that the race shows whichever way it
    would go."""
    for _ in range(3):
        with WorkerGroup(spec(4)) as group:
            group.start()
            ids = ids_of(group)
        assert_killed(ids)


def fail_on_rank_one(channel):
    if os.environ["RANK"] == "1":
        raise ValueError("boom on purpose")
    time.sleep(60)  # the healthy ranks would wait forever in a collective; the group kills them


def die_on_rank_two(channel):
    if os.environ["RANK"] == "2":
        os._exit(9)
    time.sleep(60)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize(("fn", "rank", "what"), [(fail_on_rank_one, 1, "boom on purpose"), (die_on_rank_two, 2, "")])
def test_a_failing_rank_is_reported_at_once(fn, rank, what):
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=f"rank {rank} .*{what}"), WorkerGroup(spec(3)) as group:
        group.start()
        group.run(fn)
    assert time.monotonic() - start < 30  # not after the healthy ranks' 60 s sleep


def report_steps(channel):
    for step in range(1, 4):
        channel.report(step=step)
        time.sleep(0.6)
    return os.environ["RANK"]


@pytest.mark.usefixtures("ray_cluster")
def test_progress_reaches_the_driver_while_ranks_run():
    seen, results = [], {}
    with WorkerGroup(spec(2)) as group:
        group.start()
        group.launch(report_steps)
        # A deadline that passed between the caller's check and its `deadline - now` (a loaded machine:
        # CI once lost a run to Ray's ValueError here) is a look without waiting.
        assert group.poll(timeout_s=-0.01) == []
        deadline = time.monotonic() + 60
        while group.calls and time.monotonic() < deadline:
            results.update((rank, value) for rank, value, _ in group.poll(timeout_s=0.2))
            seen.append(group.progress()[0].step)
        ids = ids_of(group)
    assert_killed(ids)
    assert results == {0: "0", 1: "1"}
    assert {1, 2} & set(seen)  # polled mid-run, while `run` held the actors' other thread


@pytest.mark.usefixtures("ray_cluster")
def test_a_placement_group_that_is_gone_fails_a_replacement_in_one_line():
    """Ray answers a wait on a placement group that has gone with TaskPlacementGroupRemoved (a run saw it when a
    node was marked dead): a replacement asked for then fails in one PlacementError line, which the supervisor
    answers with a new group (its retry), not a traceback."""
    with WorkerGroup(spec(1)) as group:
        group.start()
        remove_placement_group(group.roster.pg)
        with pytest.raises(PlacementError) as gone:
            group.replace(0)
    line = str(gone.value)
    assert line.startswith("could not restart 1 workers: their placement group is gone (TaskPlacementGroupRemoved")
    assert "\n" not in line


@pytest.mark.usefixtures("ray_cluster")
def test_capacity_check_refuses_what_can_never_be_placed():
    cpus = ray.cluster_resources()["CPU"]
    with pytest.raises(CapacityError, match="cluster.num_workers=3"):
        check_capacity(3, cpus / 2, 0)
    check_capacity(4, cpus / 4, 0)
    # Hot spares and parameter servers take a worker's CPUs each, and the message names them.
    with pytest.raises(CapacityError, match=r"cluster.num_workers=3 with ps.num_servers=2 needs"):
        check_capacity(3, cpus / 4, 0, num_servers=2)
    with pytest.raises(CapacityError, match=r"cluster.num_workers=4 with cluster.spares=1 needs 5 CPU"):
        check_capacity(4, cpus / 4, 0, spares=1)


@pytest.mark.timeout(120)
def test_a_program_that_imported_ray_first_starts_the_embedded_cluster_quietly_and_ends_it_at_once(tmp_path):
    """Ray caches its auth mode when imported: distrain must not set RAY_AUTH_MODE behind its back (a cluster
    started with token auth and a driver connecting without it fail), nor print Ray's auth warning. The cluster's
    processes block SIGTERM (runtime.sigterm_held): Ray's shutdown sends them none, which it then waited a second
    on for each (five in all, at every end of the driver), and ends every one of them."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    code = "\n".join(
        (
            "import os, subprocess, ray",
            "from distrain.cluster.runtime import connect",
            "connect(None, 1, 0)",
            "print('up', ray.is_initialized())",
            "node = ray._private.worker._global_node",
            "pids = [p.process.pid for each in node.all_processes.values() for p in each]",
            "terminated, terminate = [], subprocess.Popen.terminate",
            "subprocess.Popen.terminate = lambda p: (terminated.append(p.pid), terminate(p))[1]",
            "ray.shutdown()",
            "print('SIGTERM', len(terminated), 'alive', [p for p in pids if os.path.exists(f'/proc/{p}')])",
        )
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0 and "up True" in done.stdout, done.stderr[-2000:]
    assert "Token authentication" not in done.stdout + done.stderr
    assert "SIGTERM 0 alive []" in done.stdout, done.stdout


def test_a_start_that_timed_out_is_told_what_to_do_on_a_loaded_machine():
    from distrain.cluster.runtime import not_started

    slow = not_started("Exception: The current node timed out during startup")
    assert "on a loaded machine Ray's processes may need longer" in slow and "distrain cluster start" in slow
    assert "loaded machine" not in not_started("PermissionError: [Errno 1] Operation not permitted")
