"""One object for a run's layout, in plain Python: mesh sizes, rank coordinates, data shards,
process groups, pipeline stages, micro-batches, and the smaller layouts an elastic run may shrink to.

`Layout.resolve(cfg)` fills what the strategy leaves open from the worker count, without touching
the config, and refuses a layout that cannot work with a one-line ConfigError. The driver resolves
it once; the plan prints it; workers receive it as a plain dict. It imports neither torch nor Ray.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from distrain.config import ConfigError, TrainConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost to innermost
TP_MODES = ("1d", "2d", "2.5d", "3d")


def _root(n: int, k: int) -> int | None:
    """The integer k-th root of n, if n is a k-th power."""
    r = round(n ** (1 / k))
    return next((c for c in (r - 1, r, r + 1) if c >= 1 and c**k == n), None)


def tp_grid(mode: str, tp: int, depth: int = 1) -> tuple[tuple[str, int], ...]:
    """The tensor-parallel sub-mesh: its dims (outermost first) and sizes, whose product is tp. The
    ranks keep their row-major order, so the grid is a reshape of the one `tp` dim. 3d's names are the
    indices of Y_ij = Σ_k X_ik W_kj, its batch axis i innermost (distrain/parallel/tpnd/cube.py)."""
    _require(mode in TP_MODES, f"strategy.tp_mode={mode!r} is not a tensor-parallel mode; choose one of: "
             f"{', '.join(TP_MODES)}")  # fmt: skip
    _require(depth >= 1, f"strategy.tp_depth={depth}: must be at least 1")
    _require(depth == 1 or mode == "2.5d", f"strategy.tp_depth={depth} is for strategy.tp_mode=2.5d only")
    if mode == "1d":
        return (("tp", tp),)
    if mode == "3d":
        q = _root(tp, 3)
        _require(q is not None, f"strategy.tp={tp} is not a cube; tp_mode=3d needs q³ ranks (8, 27, 64, …)")
        return (("tp_j", q), ("tp_k", q), ("tp_i", q))
    _require(tp % depth == 0, f"strategy.tp={tp} is not divisible by strategy.tp_depth={depth}")
    q = _root(tp // depth, 2)
    if mode == "2d":
        _require(q is not None, f"strategy.tp={tp} is not a square; tp_mode=2d needs q² ranks (4, 9, 16, …)")
        return (("tp_row", q), ("tp_col", q))
    _require(
        q is not None,
        f"strategy.tp={tp} is not tp_depth × a square = {depth} × q²; tp_mode=2.5d needs d·q² ranks (8 = 2 × 2², …)",
    )
    return (("tp_depth", depth), ("tp_row", q), ("tp_col", q))


@dataclass(frozen=True)
class Schedule:
    """What the driver must know of a pipeline schedule (parallel/pipeline.py maps names to classes)."""

    multi_stage: bool  # several stages per rank (2 by default), looped over the ranks
    all_at_once: bool  # every forward before any backward: all micro-batches' activations in flight
    split_backward: bool  # zero-bubble: input- and weight-gradients computed apart


SCHEDULES = {
    "gpipe": Schedule(multi_stage=False, all_at_once=True, split_backward=False),
    "1f1b": Schedule(multi_stage=False, all_at_once=False, split_backward=False),
    "interleaved_1f1b": Schedule(multi_stage=True, all_at_once=False, split_backward=False),
    "looped_bfs": Schedule(multi_stage=True, all_at_once=True, split_backward=False),
    "interleaved_zb": Schedule(multi_stage=True, all_at_once=False, split_backward=True),
}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


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

    @classmethod
    def resolve(cls, cfg: TrainConfig, world_size: int | None = None) -> Layout:
        """The layout of `cfg` on `world_size` workers (default cluster.num_workers): the one -1
        data-parallel dim gets the workers the others leave, stages_per_rank its schedule's default."""
        s, t = cfg.strategy, cfg.trainer
        n = cfg.cluster.num_workers if world_size is None else world_size
        _require(n >= 1, f"cluster.num_workers={n}: need at least 1 worker")
        for key, v in (("tp", s.tp), ("pp", s.pp)):
            _require(v >= 1, f"strategy.{key}={v}: must be at least 1")
        for key, v in (("dp_replicate", s.dp_replicate), ("dp_shard", s.dp_shard)):
            _require(v >= 1 or v == -1, f"strategy.{key}={v}: must be at least 1, or -1 for the workers left")
        _require(
            s.dp_replicate != -1 or s.dp_shard != -1,
            "strategy.dp_replicate and strategy.dp_shard are both -1; set one of them to a size",
        )
        fixed = s.pp * s.tp * max(s.dp_replicate, 1) * max(s.dp_shard, 1)
        if -1 in (s.dp_replicate, s.dp_shard):
            _require(
                n % fixed == 0,
                f"cluster.num_workers={n} is not divisible by strategy.pp × tp × the fixed data-parallel dim "
                f"= {fixed}; use a multiple of {fixed} workers",
            )
        else:
            _require(
                fixed == n,
                f"strategy.dp_replicate × dp_shard × tp × pp = {fixed} but cluster.num_workers={n}; "
                f"make them equal or set strategy.dp_replicate=-1",
            )
        rest = n // fixed
        dp_replicate = rest if s.dp_replicate == -1 else s.dp_replicate
        dp_shard = rest if s.dp_shard == -1 else s.dp_shard
        _require(
            s.schedule in SCHEDULES,
            f"strategy.schedule={s.schedule!r} is not a known pipeline schedule; choose one of: {', '.join(SCHEDULES)}",
        )
        multi = SCHEDULES[s.schedule].multi_stage
        stages_per_rank = s.stages_per_rank if s.stages_per_rank is not None else (2 if multi else 1)
        dp = dp_replicate * dp_shard
        per_step = t.micro_batch_size * dp
        _require(t.micro_batch_size >= 1, f"trainer.micro_batch_size={t.micro_batch_size}: must be ≥ 1")
        _require(
            t.global_batch_size > 0 and t.global_batch_size % per_step == 0,
            f"trainer.global_batch_size={t.global_batch_size} is not divisible by trainer.micro_batch_size × "
            f"data-parallel size = {t.micro_batch_size} × {dp} = {per_step}; use a multiple of {per_step}",
        )
        tp_grid(s.tp_mode, s.tp, s.tp_depth)
        layout = cls(
            s.pp, dp_replicate, dp_shard, s.tp, t.global_batch_size // per_step, stages_per_rank, s.schedule,
            s.tp_mode, s.tp_depth,
        )  # fmt: skip
        layout._check_sharding(cfg)
        layout._check_pipeline(cfg)
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

    def _check_sharding(self, cfg: TrainConfig) -> None:
        zero = cfg.strategy.zero
        _require(zero in (0, 1, 2, 3), f"strategy.zero={zero}: choose 0 (DDP), 1, 2 or 3")
        _require(
            zero > 0 or self.dp_shard == 1,
            f"strategy.dp_shard={self.dp_shard} shards model state but strategy.zero=0 replicates it; "
            f"set strategy.zero to 1, 2 or 3, or strategy.dp_shard=1",
        )
        _require(
            zero == 0 or self.dp_shard > 1 or self.dp_replicate == 1,
            f"strategy.zero={zero} shards over strategy.dp_shard, which is 1 (dp_replicate={self.dp_replicate}); "
            f"set strategy.dp_shard=-1 and strategy.dp_replicate=1 (or a size for each, for HSDP), or strategy.zero=0",
        )
        _require(
            zero != 1 or (self.tp == 1 and self.pp == 1 and self.dp_replicate == 1),
            f"strategy.zero=1 (ZeroRedundancyOptimizer over DDP) is not supported with tp={self.tp}, pp={self.pp}, "
            f"dp_replicate={self.dp_replicate}: it needs a 1-D data-parallel mesh; use strategy.zero=2 or 3 to "
            f"combine sharding with other dims",
        )

    def _check_pipeline(self, cfg: TrainConfig) -> None:
        _require(self.stages_per_rank >= 1, f"strategy.stages_per_rank={self.stages_per_rank}: must be ≥ 1")
        if self.pp == 1:
            return
        multi = SCHEDULES[self.schedule].multi_stage
        _require(
            multi or self.stages_per_rank == 1,
            f"strategy.schedule={self.schedule} runs one stage per rank; set strategy.stages_per_rank=1 "
            f"or choose interleaved_1f1b",
        )
        n_layers = cfg.model.n_layers
        _require(
            self.num_stages <= n_layers,
            f"strategy.pp × stages_per_rank = {self.num_stages} stages but model.n_layers={n_layers}; "
            f"every stage needs a layer: lower strategy.pp or strategy.stages_per_rank",
        )
        m = self.micro_batches
        _require(
            m >= self.pp and (not multi or m % self.pp == 0),
            f"strategy.schedule={self.schedule} on strategy.pp={self.pp} needs {'a multiple of ' if multi else ''}"
            f"at least {self.pp} micro-batches per step, but trainer.global_batch_size / (micro_batch_size × "
            f"data-parallel size) = {m}; raise trainer.global_batch_size or lower trainer.micro_batch_size",
        )

    # -- sizes ------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank if self.pp > 1 else 1

    @property
    def loss_holders(self) -> int:
        """Ranks that compute the loss of each data shard: its tensor-parallel peers, on the last stage."""
        return self.world_size // self.pp

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    def mesh_sizes(self) -> dict[str, int]:
        """The device mesh's dims: `sizes()` with tp laid out as its grid."""
        grid = dict(tp_grid(self.tp_mode, self.tp, self.tp_depth))
        sizes: dict[str, int] = {}
        for name, size in self.sizes().items():
            sizes.update(grid if name == "tp" else {name: size})
        return sizes

    # -- ranks ------------------------------------------------------------------------------------

    def coordinate(self, rank: int) -> dict[str, int]:
        """Rank → its position on each mesh dim; row-major, as `init_device_mesh` lays ranks out,
        so tensor-parallel peers are consecutive ranks (the same node once ranks are sorted by node)."""
        coord = {}
        for name in reversed(MESH_DIMS):
            size = getattr(self, name)
            coord[name] = rank % size
            rank //= size
        return {name: coord[name] for name in MESH_DIMS}

    def tp_coordinate(self, rank: int) -> dict[str, int]:
        """Rank → its position on the tensor-parallel grid's dims (the tp coordinate, reshaped)."""
        t, coord = self.coordinate(rank)["tp"], {}
        for name, size in reversed(tp_grid(self.tp_mode, self.tp, self.tp_depth)):
            coord[name], t = t % size, t // size
        return dict(reversed(coord.items()))

    def data_shard(self, rank: int) -> tuple[int, int]:
        """The rank's slice of the global batch: its index over the data-parallel dims, and their size."""
        c = self.coordinate(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"], self.dp

    def mesh_coordinate(self, rank: int) -> dict[str, int]:
        """Rank → its position on each device-mesh dim (`mesh_sizes`): tp as its grid."""
        c = self.coordinate(rank)
        return {**{name: c[name] for name in MESH_DIMS[:-1]}, **self.tp_coordinate(rank)}  # tp is innermost

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
