"""One object for a run's layout, in plain Python: each mesh dim's size, the settings the parallelisms
resolved (micro-batches, the pipeline's schedule, tensor parallelism's mode, ...), the device mesh's dims,
and the arithmetic of ranks over them.

It names no parallelism: its dims and settings are what the records of distrain/strategy/ registered
(distrain/strategy/resolve.py fills them from a config), so a new parallelism, or a new dim, changes the
records and not this file. The driver resolves it once; the plan prints it; ranks receive it as it is (in a
RankJob), the parameter server's as a plain dict; each rank builds its device meshes from it
(distrain/parallel/mesh.py). It imports neither torch nor Ray.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    dims: dict[str, int]  # each parallelism's dims and their sizes, outermost first
    settings: dict[str, Any]  # each parallelism's other resolved fields: micro_batches, schedule, tp_mode, ...
    mesh_dims: dict[str, int]  # the device mesh's dims: `dims` with each laid out as its parallelism lays it

    def __getattr__(self, name: str) -> Any:
        """A dim's size or a setting by its name (`layout.tp`, `layout.schedule`)."""
        fields = self.__dict__
        if name in fields.get("dims", {}):
            return fields["dims"][name]
        if name in fields.get("settings", {}):
            return fields["settings"][name]
        raise AttributeError(f"a layout has no dim or setting {name!r}")

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        return cls(**d)

    def as_dict(self) -> dict:
        return asdict(self)

    # -- sizes ------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return math.prod(self.dims.values())

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def gradient_width(self) -> int:
        """Ranks holding the same weights and different tokens: data parallelism's, with cp folded in."""
        return self.dp * self.cp

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank if self.pp > 1 else 1

    @property
    def loss_holders(self) -> int:
        """Ranks that compute the loss of each data shard: its tensor- and context-parallel peers (each the
        mean over its share of the tokens, equal shares), on the last stage."""
        return self.world_size // self.pp

    def sizes(self) -> dict[str, int]:
        return dict(self.dims)

    def mesh_sizes(self) -> dict[str, int]:
        return dict(self.mesh_dims)

    # -- ranks ------------------------------------------------------------------------------------

    def coordinate(self, rank: int) -> dict[str, int]:
        """Rank → its position on each mesh dim; row-major, as `init_device_mesh` lays ranks out,
        so tensor-parallel peers are consecutive ranks (the same node once ranks are sorted by node)."""
        return _unravel(rank, self.dims)

    def data_shard(self, rank: int) -> tuple[int, int]:
        """The rank's slice of the global batch: its index over the data-parallel dims, and their size."""
        c = self.coordinate(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"], self.dp

    def shard_of(self, rank: int) -> tuple[int, ...]:
        """Which part of the training state a rank holds: its coordinate on every dim but dp_replicate, whose
        ranks hold the same weights and optimizer state (the replicas a failed rank's state is taken from), and its
        expert-parallel rank: expert parallelism borrows ranks of the gradient group, dp_replicate's among them."""
        c = self.coordinate(rank)
        return (*(v for k, v in c.items() if k != "dp_replicate"), self.expert_rank(rank))

    def expert_rank(self, rank: int) -> int:
        """Which experts' share a rank holds: its place in its gradient group (dp_replicate, dp_shard, cp,
        row-major) modulo ep, whose ranks are consecutive there (0 without expert parallelism)."""
        c = self.coordinate(rank)
        place = (c["dp_replicate"] * self.dp_shard + c["dp_shard"]) * self.cp + c["cp"]
        return place % self.settings.get("ep", 1)

    def mesh_coordinate(self, rank: int) -> dict[str, int]:
        """Rank → its position on each device-mesh dim (`mesh_dims`); row-major, so a dim laid out as a
        grid has its coordinate reshaped."""
        return _unravel(rank, self.mesh_dims)

    def groups(self, dim: str) -> list[list[int]]:
        """The ranks of every process group along mesh dim `dim` (ranks equal on every other dim)."""
        by_rest: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.mesh_coordinate(rank)
            by_rest.setdefault(tuple(v for k, v in c.items() if k != dim), []).append(rank)
        return list(by_rest.values())

    # -- pipeline ---------------------------------------------------------------------------------

    def stages(self, pp_rank: int) -> list[int]:
        """The pipeline stages a rank holds, looped: rank r holds r, r + pp, r + 2·pp, ..."""
        return [pp_rank + i * self.pp for i in range(self.stages_per_rank)] if self.pp > 1 else [0]


def _unravel(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """A rank's coordinate on dims of `sizes` (outermost first), in row-major order."""
    coord = {}
    for name, size in reversed(sizes.items()):
        coord[name], rank = rank % size, rank // size
    return dict(reversed(coord.items()))
