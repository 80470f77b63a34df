"""Place N workers, give each its rank and torchrun-style environment, run a function on all."""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from distrain.cluster.worker import RemoteWorker


class PlacementError(RuntimeError):
    """The workers could not be placed in time, or not with each block of node_group ranks on one node."""


class WorkerFailure(RuntimeError):
    """A rank raised or its process died; the original error is chained."""


@dataclass(frozen=True)
class GroupSpec:
    num_workers: int
    cpus_per_worker: float
    gpus_per_worker: int
    threads_per_worker: int
    placement_strategy: str = "PACK"
    placement_timeout_s: float = 120.0
    env: tuple[tuple[str, str], ...] = ()  # extra variables for every worker
    # Ranks that must share a node: the tensor-parallel size. Every block of node_group consecutive
    # ranks lands on one node, so a TP group's collectives never cross the network.
    node_group: int = 1

    def __post_init__(self) -> None:
        if self.node_group < 1 or self.num_workers % self.node_group:
            raise ValueError(f"num_workers={self.num_workers} is not a multiple of node_group={self.node_group}")

    def bundle(self) -> dict[str, float]:
        """One placement-group bundle holds one block of node_group workers: Ray never splits a
        bundle across nodes, and the placement strategy then applies to whole blocks."""
        per_worker = {"CPU": self.cpus_per_worker, "GPU": self.gpus_per_worker}
        return {k: v * self.node_group for k, v in per_worker.items() if v}


def rank_table(infos: list[dict], node_group: int = 1) -> list[dict]:
    """Ranks in (node IP, node, GPU) order, so neighbouring ranks share a node and a node's GPUs
    are in order; each entry gets rank, local_rank, node_rank and its index in `infos`.

    When every node holds a multiple of node_group workers, this order keeps each block of
    node_group consecutive ranks on one node; otherwise no order can, and PlacementError says so.
    """

    def key(i: int) -> tuple:
        info = infos[i]
        return (ipaddress.ip_address(info["node_ip"]), info["node_id"], info["gpu_ids"], i)

    table, nodes = [], {}
    for rank, i in enumerate(sorted(range(len(infos)), key=key)):
        node = nodes.setdefault(infos[i]["node_id"], {"node_rank": len(nodes), "members": 0})
        table.append(
            {**infos[i], "rank": rank, "worker_index": i, "node_rank": node["node_rank"], "local_rank": node["members"]}
        )
        node["members"] += 1
    for entry in table:
        entry["local_world_size"] = nodes[entry["node_id"]]["members"]
    check_blocks(table, node_group)
    return table


def check_blocks(table: list[dict], node_group: int) -> None:
    """Raise PlacementError if some block of node_group consecutive ranks spans nodes: its
    tensor-parallel collectives would run over the network, silently and slowly."""
    for start in range(0, len(table), node_group):
        block = table[start : start + node_group]
        if len({e["node_id"] for e in block}) > 1:
            per_node = Counter(f"{e['node_ip']}/{e['node_id'][:8]}" for e in table)
            raise PlacementError(
                f"ranks {start}-{start + len(block) - 1} must share a node (node_group={node_group}) but do not; "
                f"workers per node {dict(per_node)} must each be a multiple of {node_group}"
            )


class WorkerGroup:
    def __init__(self, spec: GroupSpec):
        self.spec = spec
        self.pg = None
        self.workers: list = []  # in rank order once started
        self.table: list[dict] = []

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> list[dict]:
        """Reserve one bundle per block of node_group workers, start the actors, then rank them by
        where they landed; on any failure remove what was reserved and started."""
        try:
            return self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> list[dict]:
        s = self.spec
        bundle, blocks = s.bundle(), s.num_workers // s.node_group
        what = f"{s.num_workers} workers" + (f" in blocks of {s.node_group} per node" if s.node_group > 1 else "")
        fits = _blocks_that_fit(bundle)
        if sum(fits.values()) < blocks:
            raise PlacementError(
                f"cannot place {what}: each block needs {bundle} on one node, and the nodes hold {fits} blocks "
                f"({sum(fits.values())} < {blocks}); use fewer workers or a smaller tensor-parallel size"
            )
        self.pg = placement_group([bundle] * blocks, strategy=s.placement_strategy)
        try:
            ray.get(self.pg.ready(), timeout=s.placement_timeout_s)
        except GetTimeoutError as e:
            raise PlacementError(
                f"could not place {what} ({bundle} per bundle) within "
                f"cluster.placement_timeout_s={s.placement_timeout_s:g}; the cluster has "
                f"{ray.available_resources()} free"
            ) from e
        self.workers = workers = [
            RemoteWorker.options(
                num_cpus=s.cpus_per_worker,
                num_gpus=s.gpus_per_worker,
                max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=i // s.node_group
                ),
            ).remote()
            for i in range(s.num_workers)
        ]
        self.table = rank_table(ray.get([w.node_info.remote() for w in workers]), s.node_group)
        self.workers = [workers[entry["worker_index"]] for entry in self.table]
        return self.table

    def environments(self) -> list[dict[str, str]]:
        """What torchrun would set for each rank, plus threads and the node's visible GPUs."""
        master = self.table[0]
        port = ray.get(self.workers[0].free_port.remote())
        envs = []
        for entry in self.table:
            env = {
                "RANK": entry["rank"],
                "LOCAL_RANK": entry["local_rank"],
                "WORLD_SIZE": len(self.table),
                "LOCAL_WORLD_SIZE": entry["local_world_size"],
                "NODE_RANK": entry["node_rank"],
                "GROUP_RANK": entry["node_rank"],
                "MASTER_ADDR": master["node_ip"],
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": self.spec.threads_per_worker,
                # Every rank on a node sees all of the group's GPUs there (as under torchrun), so
                # NCCL can use peer-to-peer links; LOCAL_RANK indexes them, in GPU-id order. A CPU
                # worker sees none: Ray no longer hides a GPU machine's GPUs from num_gpus=0 actors.
                "CUDA_VISIBLE_DEVICES": ",".join(
                    map(str, sorted(g for e in self.table if e["node_id"] == entry["node_id"] for g in e["gpu_ids"]))
                ),
                **dict(self.spec.env),
            }
            envs.append({k: str(v) for k, v in env.items()})
        return envs

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        on_progress: Callable[[list[dict]], None] | None = None,
        poll_s: float = 1.0,
    ) -> list[Any]:
        """Run fn(*args, report) on every rank; return the results in rank order.

        Waits on the ranks' calls themselves, so a rank that raises or whose process dies is
        seen at once, not at the next poll; the first failure raises WorkerFailure.
        """
        refs = {
            w.run.remote(fn, env, *args): rank
            for rank, (w, env) in enumerate(zip(self.workers, self.environments(), strict=True))
        }
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=poll_s)
            for ref in done:
                rank = refs[ref]
                try:
                    results[rank] = ray.get(ref)
                except RayError as e:
                    entry = self.table[rank]
                    raise WorkerFailure(
                        f"rank {rank} (pid {entry['pid']} on {entry['node_ip']}) failed: {_first_line(e)}"
                    ) from e
            if on_progress is not None:
                on_progress(self.progress())  # also once after the last rank finished: its final report
        return results

    def progress(self) -> list[dict]:
        """The latest progress each rank reported ({} for a rank that has not reported or is gone)."""
        refs = [w.progress.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref) if ref in ready else {})
            except RayError:
                out.append({})
        return out

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def _blocks_that_fit(bundle: dict[str, float]) -> dict[str, int]:
    """How many bundles each alive node could ever hold, by its total resources: a group that needs
    more fails now, not after placement_timeout_s."""
    fits = {}
    for node in ray.nodes():
        if node["Alive"]:
            total = node["Resources"]
            name = f"{node['NodeManagerAddress']}/{node['NodeID'][:8]}"
            fits[name] = min(int(total.get(k, 0) / v + 1e-9) for k, v in bundle.items())
    return fits


def _first_line(error: Exception) -> str:
    cause = getattr(error, "cause", None) or error
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}"
