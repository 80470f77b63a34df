"""Tensor-parallel blocks never span nodes: rank_table on fake nodes, and real placement on a
multi-node `ray.cluster_utils.Cluster` whose uneven nodes make a naive PACK split a TP pair.

One process can join only one Ray cluster and the session's tests share an embedded one, so the
multi-node scenarios run in a subprocess: this file run as a script prints their results as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported, also when run as a script:
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # the cluster binds 127.0.0.1 only and phones nobody

import pytest  # noqa: E402

from distrain.cluster.placement import GroupSpec, PlacementError, rank_table  # noqa: E402
from distrain.cluster.places import WorkerPlace  # noqa: E402
from distrain.cluster.worker_group import WorkerGroup  # noqa: E402

# (CPUs, GPUs) of the head and two more nodes. One-CPU workers: PACK fills a 3-CPU node first, so 4
# land 3 + 1, and 8 can only land 3 + 3 + 2. The (logical) GPUs hold 2 + 1 + 1 pairs.
NODES = ((3, 4), (3, 3), (2, 2))


def spans(nodes: list[str], tp: int) -> list[int]:
    """The first rank of every block of tp consecutive ranks that is not on one node."""
    return [start for start in range(0, len(nodes), tp) if len(set(nodes[start : start + tp])) > 1]


def fake_info(node: str, ip: str, gpu: int, pid: int) -> WorkerPlace:
    return WorkerPlace(node, ip, None, [gpu], pid, bundle=pid)


def test_rank_table_keeps_blocks_on_one_node():
    # Two blocks per node, handed over interleaved, with GPU ids shuffled across blocks.
    infos = [
        fake_info("b", "10.0.0.2", 1, 1),
        fake_info("a", "10.0.0.1", 3, 2),
        fake_info("b", "10.0.0.2", 0, 3),
        fake_info("a", "10.0.0.1", 0, 4),
        fake_info("a", "10.0.0.1", 2, 5),
        fake_info("b", "10.0.0.2", 3, 6),
        fake_info("a", "10.0.0.1", 1, 7),
        fake_info("b", "10.0.0.2", 2, 8),
    ]
    table = rank_table(infos, node_group=2)
    assert [e.node_id for e in table] == ["a"] * 4 + ["b"] * 4
    assert [e.gpu_ids[0] for e in table] == [0, 1, 2, 3] * 2  # local_rank indexes the node's GPUs in order
    assert [e.local_rank for e in table] == [0, 1, 2, 3] * 2
    assert spans([e.node_id for e in table], 2) == []


def test_rank_table_refuses_a_block_across_nodes():
    infos = [fake_info("a", "10.0.0.1", g, g) for g in range(3)] + [fake_info("b", "10.0.0.2", 0, 3)]
    assert len(rank_table(infos)) == 4  # without the constraint, 3 + 1 is a valid layout
    with pytest.raises(PlacementError, match=r"ranks 2-3 must share a node \(node_group=2\).*multiple of 2"):
        rank_table(infos, node_group=2)


def test_group_spec_needs_whole_blocks():
    with pytest.raises(ValueError, match="num_workers=6 is not a multiple of node_group=4"):
        GroupSpec(num_workers=6, cpus_per_worker=1, gpus_per_worker=0, threads_per_worker=1, node_group=4)
    spec = GroupSpec(num_workers=4, cpus_per_worker=0.25, gpus_per_worker=1, threads_per_worker=1, node_group=2)
    assert spec.bundle() == {"CPU": 0.5, "GPU": 2}


def run_script(script: str, *args: str, timeout_s: float) -> tuple[int, str, str]:
    """Run a test file as a script (its multi-node scenario, on a Cluster of its own) in a session
    of its own, so that a hung run is ended with its whole cluster; (exit status, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, script, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return proc.returncode, out, err


def test_tp_blocks_never_span_nodes_on_an_uneven_cluster():
    code, out, err = run_script(__file__, timeout_s=120)
    assert code == 0, err[-3000:]
    results = json.loads(out.strip().splitlines()[-1])

    # The naive layout splits a TP pair: 4 workers land 3 + 1; 8 on nodes of 3, 3, 2 can only land so.
    assert spans(results["tp2_naive"]["nodes"], 2) != []
    assert spans(results["tp2_pp2_naive"]["nodes"], 2) != []
    # node_group=tp keeps every pair on one node, with CPU workers and with (logical) GPU workers.
    assert len(results["tp2"]["nodes"]) == 4 and spans(results["tp2"]["nodes"], 2) == []
    gpus = results["tp2_pp2_gpu"]
    assert len(gpus["nodes"]) == 8 and spans(gpus["nodes"], 2) == []
    assert sorted(Counter(gpus["nodes"]).values()) == [2, 2, 4]  # the 3-GPU node holds one pair only
    for node in set(gpus["nodes"]):  # on each node, local ranks follow GPU ids
        ids = [g for n, g in zip(gpus["nodes"], gpus["gpu_ids"], strict=True) if n == node]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
    # What cannot be placed fails clearly: at once when no node layout could hold the blocks, after
    # placement_timeout_s when the blocks would fit but the resources are taken.
    assert "cannot place 8 workers in blocks of 2 per node" in results["too_big"]["error"]
    assert "could not place 4 workers in blocks of 2 per node" in results["busy"]["error"]
    assert results["busy"]["seconds"] < 10
    # Every placement group is removed and every resource given back, on success and on failure.
    assert set(results["pg_states"]) == {"REMOVED"}
    assert results["leaked_cpus"] == 0
    assert results["ray_pids"], "the cluster's processes were not found"
    deadline = time.monotonic() + 10  # workers whose raylet is gone exit on their own, soon
    while (alive := [pid for pid in results["ray_pids"] if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive == [], f"processes left behind: {alive}"


def _alive(pid: int) -> bool:
    """Unlike fsutil.alive, a zombie counts as ended: an exited process whose parent has not reaped it yet."""
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]
    except FileNotFoundError:
        return False


def _descendants(root: int) -> list[int]:
    """Every process below `root`, from /proc (no psutil here)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += children
        frontier = children
    return found


def _place(spec: GroupSpec) -> dict:
    """Start the group, report where each rank landed (or the error), and shut it down."""
    import ray

    started, free = time.monotonic(), ray.available_resources().get("CPU", 0)
    group = WorkerGroup(spec)
    try:
        table = group.start()
        result = {
            "nodes": [e.node_id for e in table],
            "gpu_ids": [e.gpu_ids[0] if e.gpu_ids else None for e in table],
        }
    except PlacementError as e:
        result = {"error": str(e)}
    finally:
        group.shutdown()
    result["seconds"] = time.monotonic() - started
    _wait_for_cpus(free)
    return result


def _wait_for_cpus(free: float) -> None:
    """Killed actors and removed placement groups give their CPUs back asynchronously."""
    import ray

    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < free and time.monotonic() < deadline:
        time.sleep(0.1)


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group_table

    def spec(n: int, node_group: int, gpus: int = 0, timeout_s: float = 30) -> GroupSpec:
        cpus = 0.25 if gpus else 1.0
        return GroupSpec(n, cpus, gpus, 1, placement_timeout_s=timeout_s, node_group=node_group)

    node = {"node_ip_address": "127.0.0.1", "object_store_memory": 80 * 2**20}
    (head_cpus, head_gpus), *others = NODES
    head = {**node, "num_cpus": head_cpus, "num_gpus": head_gpus, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for cpus, gpus in others:
            cluster.add_node(**node, num_cpus=cpus, num_gpus=gpus)
        ray.init(address=cluster.address, logging_level="WARNING")
        cluster.wait_for_nodes()
        results = {
            "tp2_naive": _place(spec(4, 1)),
            "tp2": _place(spec(4, 2)),
            "tp2_pp2_naive": _place(spec(8, 1)),
            "too_big": _place(spec(8, 2)),
            "tp2_pp2_gpu": _place(spec(8, 2, gpus=1)),
        }
        with WorkerGroup(spec(4, 2)) as holder:  # takes two of the three blocks the nodes can hold
            holder.start()
            results["busy"] = _place(spec(4, 2, timeout_s=1))
        _wait_for_cpus(ray.cluster_resources()["CPU"])
        results["pg_states"] = [pg["state"] for pg in placement_group_table().values()]
        results["leaked_cpus"] = ray.cluster_resources()["CPU"] - ray.available_resources().get("CPU", 0)
        results["ray_pids"] = _descendants(os.getpid())
        ray.shutdown()
    finally:
        cluster.shutdown()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
