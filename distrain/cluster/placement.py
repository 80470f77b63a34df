"""Where workers go: the group's shape, where each started worker runs, the rank order over nodes (the rank
table), and whether it fits.

Placement is in blocks of node_group workers (one placement-group bundle each), so a block, a
tensor-parallel group, is never split across nodes.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from distrain.cluster.places import RankPlace, WorkerPlace


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
    start_timeout_s: float = 600.0  # for placed actors to start (a process; on clusters, a runtime env)
    env: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # for every worker; holds secrets (W&B key)
    # Ranks that must share a node: the tensor-parallel size. Every block of node_group consecutive
    # ranks lands on one node, so a TP group's collectives never cross the network.
    node_group: int = 1
    spares: int = 0  # hot spares: one worker's bundle each, started with the group, holding no rank

    def __post_init__(self) -> None:
        if self.node_group < 1 or self.num_workers % self.node_group:
            raise ValueError(f"num_workers={self.num_workers} is not a multiple of node_group={self.node_group}")

    def bundle(self) -> dict[str, float]:
        """One placement-group bundle holds one block of node_group workers: Ray never splits a
        bundle across nodes, and the placement strategy then applies to whole blocks."""
        return {k: v * self.node_group for k, v in self.worker_resources().items()}

    def worker_resources(self) -> dict[str, float]:
        """What one worker holds; a hot spare's bundle."""
        return {k: v for k, v in {"CPU": self.cpus_per_worker, "GPU": self.gpus_per_worker}.items() if v}

    def bundles(self) -> list[dict[str, float]]:
        """The placement group: a bundle per block of ranks, then one per spare."""
        return [self.bundle()] * (self.num_workers // self.node_group) + [self.worker_resources()] * self.spares


def rank_table(places: list[WorkerPlace], node_group: int = 1) -> list[RankPlace]:
    """Ranks in (node IP, node, GPU) order, so neighbouring ranks share a node and a node's GPUs
    are in order; each row gets rank, local_rank, node_rank and its index in `places`.

    When every node holds a multiple of node_group workers, this order keeps each block of
    node_group consecutive ranks on one node; otherwise no order can, and PlacementError says so.
    """

    def key(i: int) -> tuple:
        place = places[i]
        return (ipaddress.ip_address(place.node_ip), place.node_id, place.gpu_ids, i)

    order = sorted(range(len(places)), key=key)
    table = [RankPlace(**vars(places[i]), rank=rank, worker_index=i) for rank, i in enumerate(order)]
    number_nodes(table)
    check_blocks(table, node_group)
    return table


def number_nodes(table: list[RankPlace]) -> None:
    """Set node_rank (nodes in order of their first rank), local_rank (the worker's place among its
    node's workers in GPU-id order, which CUDA_VISIBLE_DEVICES follows) and local_world_size on
    every entry, in place: also after one rank was replaced on another node or GPU."""
    nodes: dict[str, list[RankPlace]] = {}
    for row in table:
        nodes.setdefault(row.node_id, []).append(row)
    for node_rank, members in enumerate(nodes.values()):
        for local_rank, row in enumerate(sorted(members, key=lambda e: (e.gpu_ids, e.rank))):
            row.node_rank, row.local_rank, row.local_world_size = node_rank, local_rank, len(members)


def check_blocks(table: list[RankPlace], node_group: int) -> None:
    """Raise PlacementError if some block of node_group consecutive ranks spans nodes: its
    tensor-parallel collectives would run over the network, silently and slowly."""
    for start in range(0, len(table), node_group):
        block = table[start : start + node_group]
        if len({e.node_id for e in block}) > 1:
            per_node = Counter(f"{e.node_ip}/{e.node_id[:8]}" for e in table)
            raise PlacementError(
                f"ranks {start}-{start + len(block) - 1} must share a node (node_group={node_group}) but do not; "
                f"workers per node {dict(per_node)} must each be a multiple of {node_group}"
            )


def blocks_that_fit(bundle: dict[str, float]) -> dict[str, int]:
    """How many bundles each alive node could ever hold, by its total resources: a group that needs
    more fails now, not after placement_timeout_s."""
    fits = {}
    for node in ray.nodes():
        if node["Alive"]:
            total = node["Resources"]
            name = f"{node['NodeManagerAddress']}/{node['NodeID'][:8]}"
            fits[name] = min(int(total.get(k, 0) / v + 1e-9) for k, v in bundle.items())
    return fits


def fitting_sizes(spec: GroupSpec, sizes: list[int]) -> list[int]:
    """The sizes whose blocks the alive nodes could hold, by their total resources."""
    capacity = sum(blocks_that_fit(spec.bundle()).values())
    return [n for n in sizes if n // spec.node_group <= capacity]


def room_for(spec: GroupSpec, workers: int, timeout_s: float = 0.5) -> bool:
    """Whether the cluster has `workers` more workers' worth of bundles free right now: a trial
    placement group, removed at once, answers exactly (per node, other jobs included)."""
    trial = placement_group([spec.bundle()] * (workers // spec.node_group), strategy=spec.placement_strategy)
    try:
        ready, _ = ray.wait([trial.ready()], timeout=timeout_s)
        return bool(ready)
    finally:
        remove_placement_group(trial)


def draining_nodes() -> dict[str, float]:
    """Node id → the wall-clock time it will be taken away (0: not known), for every node the
    autoscaler or `ray drain-node` is draining (a spot instance about to be preempted). Ray has no
    public API for it yet; this is the one Ray Train's own preemption watcher reads."""
    from ray._private.state import state

    return {node: deadline_ms / 1000 for node, deadline_ms in state.get_draining_nodes().items()}
