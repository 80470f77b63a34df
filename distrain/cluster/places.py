"""The rows of the rank table: where a started worker runs, and which rank it holds there. Neither Ray nor
torch, so that what reads the table without a cluster (the driver's --plan) needs neither."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class WorkerPlace:
    """Where a started worker actor runs: its node (id, address, the interface holding that address), its
    GPUs, its process and its bundle of the placement group."""

    node_id: str
    node_ip: str
    interface: str | None
    gpu_ids: list[int]
    pid: int
    bundle: int


@dataclass
class RankPlace(WorkerPlace):
    """A row of the rank table: a worker's place and the rank it holds; `worker_index`, its index among the
    workers the table was made from; `node_rank`, `local_rank` and `local_world_size` as torchrun sets them
    (number_nodes). As JSON, a row of placement.json."""

    rank: int
    worker_index: int
    node_rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1

    def moved_to(self, place: WorkerPlace) -> RankPlace:
        """The same rank on another worker (a replacement), to be renumbered (number_nodes)."""
        return replace(self, **vars(place))
