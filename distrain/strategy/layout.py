"""One object for a run's layout, in plain Python: mesh sizes, rank coordinates, data shards,
process groups, pipeline stages, micro-batches, and the smaller layouts an elastic run may shrink to.

`Layout.resolve(cfg)` fills what the strategy leaves open from the worker count, without touching
the config, and refuses a layout that cannot work with a one-line ConfigError. The driver resolves
it once; the plan prints it; ranks receive it as it is (in a RankJob), the parameter server's as a plain
dict. It imports neither torch nor Ray.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from distrain.config import ConfigError, TrainConfig
from distrain.strategy import PARALLELISMS, data_parallel
from distrain.strategy.pipeline import stage_layers
from distrain.strategy.record import require
from distrain.strategy.tensor_parallel import TENSOR_PARALLEL

MESH_DIMS = tuple(d for p in PARALLELISMS for d in p.dims)  # outermost to innermost: pp, dp_replicate, dp_shard, cp, tp


@dataclass(frozen=True)
class Layout:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    micro_batches: int = 1  # per step on each data-parallel rank: accumulation, or the pipeline's m
    stages_per_rank: int = 1
    schedule: str = "1f1b"
    tp_mode: str = "1d"
    tp_depth: int = 1
    cp: int = 1  # last: the fields above keep their positions
    cp_mode: str = "ring"

    @classmethod
    def resolve(cls, cfg: TrainConfig, world_size: int | None = None) -> Layout:
        """The layout of `cfg` on `world_size` workers (default cluster.num_workers): the one -1
        data-parallel dim gets the workers the others leave, stages_per_rank its schedule's default."""
        n = cfg.cluster.num_workers if world_size is None else world_size
        require(n >= 1, f"cluster.num_workers={n}: need at least 1 worker")
        fixed = {d: getattr(cfg.strategy, d) for d in MESH_DIMS if d not in data_parallel.DIMS}
        for key, v in reversed(fixed.items()):
            require(v >= 1, f"strategy.{key}={v}: must be at least 1")
        sizes = {**fixed, **data_parallel.sizes(cfg, n, fixed)}
        fields: dict = {}
        for p in PARALLELISMS:
            fields |= p.fields(cfg, sizes)
        layout = cls(**sizes, **fields)
        for p in reversed(PARALLELISMS):
            p.check(cfg, layout)
        return layout

    @classmethod
    def single(cls, micro_batches: int = 1) -> Layout:
        """One process holding the whole model (a parameter-server worker, a reference run)."""
        return cls(1, 1, 1, 1, micro_batches)

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        return cls(**d)

    def as_dict(self) -> dict:
        return asdict(self)

    # -- sizes ------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes().values())

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank if self.pp > 1 else 1

    @property
    def loss_holders(self) -> int:
        """Ranks that compute the loss of each data shard: its tensor- and context-parallel peers (each the
        mean over its share of the tokens, equal shares), on the last stage."""
        return self.world_size // self.pp

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    def mesh_sizes(self) -> dict[str, int]:
        """The device mesh's dims: `sizes()` with each dim laid out as its parallelism lays it (tp as its grid)."""
        return {name: size for p in PARALLELISMS for name, size in p.mesh_sizes(self).items()}

    # -- ranks ------------------------------------------------------------------------------------

    def coordinate(self, rank: int) -> dict[str, int]:
        """Rank → its position on each mesh dim; row-major, as `init_device_mesh` lays ranks out,
        so tensor-parallel peers are consecutive ranks (the same node once ranks are sorted by node)."""
        return _unravel(rank, self.sizes())

    def tp_coordinate(self, rank: int) -> dict[str, int]:
        """Rank → its position on the tensor-parallel grid's dims (the tp coordinate, reshaped)."""
        c = self.mesh_coordinate(rank)
        return {name: c[name] for name in TENSOR_PARALLEL.mesh_sizes(self)}

    def data_shard(self, rank: int) -> tuple[int, int]:
        """The rank's slice of the global batch: its index over the data-parallel dims, and their size."""
        c = self.coordinate(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"], self.dp

    def shard_of(self, rank: int) -> tuple[int, ...]:
        """Which part of the training state a rank holds: its coordinate on every dim but dp_replicate, whose
        ranks hold the same weights and optimizer state (the replicas a failed rank's state is taken from)."""
        return tuple(v for k, v in self.coordinate(rank).items() if k != "dp_replicate")

    def mesh_coordinate(self, rank: int) -> dict[str, int]:
        """Rank → its position on each device-mesh dim (`mesh_sizes`); row-major, so a dim laid out as a
        grid has its coordinate reshaped."""
        return _unravel(rank, self.mesh_sizes())

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

    def stage_layers(self, n_layers: int) -> list[range]:
        return stage_layers(n_layers, self.num_stages)

    # -- elastic ----------------------------------------------------------------------------------

    def smaller(self, cfg: TrainConfig) -> dict[int, Layout]:
        """What a run may shrink to after losing nodes: for each worker count below this one, down
        to cluster.min_workers, the layout if the strategy allows it with the same global batch
        (fewer workers take more accumulation steps); largest first."""
        layouts = {}
        for n in range(self.world_size - 1, (cfg.cluster.min_workers or self.world_size) - 1, -1):
            try:
                layouts[n] = Layout.resolve(cfg, n)
            except ConfigError:
                continue
        return layouts


def _unravel(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """A rank's coordinate on dims of `sizes` (outermost first), in row-major order."""
    coord = {}
    for name, size in reversed(sizes.items()):
        coord[name], rank = rank % size, rank // size
    return dict(reversed(coord.items()))
