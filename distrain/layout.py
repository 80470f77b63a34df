"""The arithmetic of a layout, in plain Python: mesh sizes, rank coordinates, pipeline stages.

The driver uses it to validate and to print a plan before any worker starts; the workers use
it to build the same mesh and the same stages. It imports neither torch nor Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost to innermost


@dataclass(frozen=True)
class Schedule:
    """What the driver must know of a pipeline schedule (parallel/pipeline.py maps names to classes)."""

    multi_stage: bool  # several stages per rank (2 by default), looped over the ranks
    all_at_once: bool  # every forward before any backward: all micro-batches' activations in flight
    split_backward: bool  # zero-bubble: input- and weight-gradients computed apart

    @property
    def default_stages_per_rank(self) -> int:
        return 2 if self.multi_stage else 1


SCHEDULES = {
    "gpipe": Schedule(multi_stage=False, all_at_once=True, split_backward=False),
    "1f1b": Schedule(multi_stage=False, all_at_once=False, split_backward=False),
    "interleaved_1f1b": Schedule(multi_stage=True, all_at_once=False, split_backward=False),
    "looped_bfs": Schedule(multi_stage=True, all_at_once=True, split_backward=False),
    "interleaved_zb": Schedule(multi_stage=True, all_at_once=False, split_backward=True),
}


def micro_batches(global_batch_size: int, micro_batch_size: int, dp: int) -> int:
    """Micro-batches per step on each data-parallel rank (the pipeline's m; accumulation otherwise)."""
    return global_batch_size // (micro_batch_size * dp)


def num_stages(pp: int, stages_per_rank: int) -> int:
    return pp * stages_per_rank if pp > 1 else 1


@dataclass(frozen=True)
class MeshSizes:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @classmethod
    def fill(cls, world_size: int, pp: int, dp_replicate: int, dp_shard: int, tp: int) -> MeshSizes:
        """Give the one data-parallel dim set to -1 the workers the others leave (at least 1)."""
        fixed = pp * tp * max(dp_replicate, 1) * max(dp_shard, 1)
        rest = max(world_size // fixed, 1)
        return cls(pp, rest if dp_replicate < 1 else dp_replicate, rest if dp_shard < 1 else dp_shard, tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    def coordinate(self, rank: int) -> dict[str, int]:
        """Rank → its position on each mesh dim; row-major, as `init_device_mesh` lays ranks out,
        so tensor-parallel peers are consecutive ranks (the same node once ranks are sorted by node)."""
        coord = {}
        for name in reversed(MESH_DIMS):
            size = getattr(self, name)
            coord[name] = rank % size
            rank //= size
        return {name: coord[name] for name in MESH_DIMS}

    def data_shard(self, rank: int) -> tuple[int, int]:
        """The rank's slice of the global batch: its index over the data-parallel dims, and their size."""
        c = self.coordinate(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"], self.dp

    def groups(self, dim: str) -> list[list[int]]:
        """The ranks of every process group along `dim` (ranks equal on every other dim)."""
        by_rest: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coordinate(rank)
            by_rest.setdefault(tuple(v for k, v in c.items() if k != dim), []).append(rank)
        return list(by_rest.values())


def stage_layers(n_layers: int, num_stages: int) -> list[range]:
    """Split the blocks into contiguous stages of near-equal cost, counting the embedding (first
    stage) and the head (last stage) as one block each; every stage gets at least one block."""
    if not 1 <= num_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {num_stages} stages")
    extra = [0] * num_stages
    extra[0] += 1
    extra[-1] += 1
    counts = [1] * num_stages
    for _ in range(n_layers - num_stages):
        cheapest = min(range(num_stages), key=lambda i: (counts[i] + extra[i], counts[i], i))
        counts[cheapest] += 1
    bounds = [sum(counts[:i]) for i in range(num_stages + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(num_stages)]


def stage_indices(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The pipeline stages a rank holds, looped: rank r holds r, r + pp, r + 2·pp, ..."""
    return [pp_rank + i * pp for i in range(stages_per_rank)]
