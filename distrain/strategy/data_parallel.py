"""Data parallelism as the driver sees it: the two data-parallel dims (replicas, and shards under ZeRO)
take the workers the other dims leave, set the micro-batches per step, and follow ZeRO's rules. Applied by
distrain/parallel/data_parallel.py."""

from __future__ import annotations

import math
from typing import Any

from distrain.config import TrainConfig
from distrain.strategy.layout import Layout
from distrain.strategy.parallelism import Parallelism, require

DIMS = ("dp_replicate", "dp_shard")


def sizes(cfg: TrainConfig, n: int, fixed: dict[str, int]) -> dict[str, int]:
    """The data-parallel dims' sizes on `n` workers, the other dims' `fixed` sizes (mesh order) given: the
    one set to -1 takes the workers they leave (an elastic run shrinks by it)."""
    s = cfg.strategy
    for key in DIMS:
        v = getattr(s, key)
        require(v >= 1 or v == -1, f"strategy.{key}={v}: must be at least 1, or -1 for the workers left")
    require(
        s.dp_replicate != -1 or s.dp_shard != -1,
        "strategy.dp_replicate and strategy.dp_shard are both -1; set one of them to a size",
    )
    product = math.prod(fixed.values()) * max(s.dp_replicate, 1) * max(s.dp_shard, 1)
    if -1 in (s.dp_replicate, s.dp_shard):
        require(
            n % product == 0,
            f"cluster.num_workers={n} is not divisible by strategy.{' × '.join(fixed)} × the fixed data-parallel "
            f"dim = {product}; use a multiple of {product} workers",
        )
    else:
        require(
            product == n,
            f"strategy.{' × '.join((*DIMS, *reversed(fixed)))} = {product} but cluster.num_workers={n}; "
            f"make them equal or set strategy.dp_replicate=-1",
        )
    rest = n // product
    return {key: rest if getattr(s, key) == -1 else getattr(s, key) for key in DIMS}


def fields(cfg: TrainConfig, sizes: dict[str, int]) -> dict[str, Any]:
    """Micro-batches per step on each data-parallel rank: gradient accumulation, or the pipeline's m."""
    t = cfg.trainer
    dp = sizes["dp_replicate"] * sizes["dp_shard"]
    per_step = t.micro_batch_size * dp
    require(t.micro_batch_size >= 1, f"trainer.micro_batch_size={t.micro_batch_size}: must be ≥ 1")
    require(
        t.global_batch_size > 0 and t.global_batch_size % per_step == 0,
        f"trainer.global_batch_size={t.global_batch_size} is not divisible by trainer.micro_batch_size × "
        f"data-parallel size = {t.micro_batch_size} × {dp} = {per_step}; use a multiple of {per_step}",
    )
    return {"micro_batches": t.global_batch_size // per_step}


def check(cfg: TrainConfig, layout: Layout) -> None:
    zero = cfg.strategy.zero
    require(zero in (0, 1, 2, 3), f"strategy.zero={zero}: choose 0 (DDP), 1, 2 or 3")
    require(
        zero > 0 or layout.dp_shard == 1,
        f"strategy.dp_shard={layout.dp_shard} shards model state but strategy.zero=0 replicates it; "
        f"set strategy.zero to 1, 2 or 3, or strategy.dp_shard=1",
    )
    require(
        zero == 0 or layout.dp_shard > 1 or layout.dp_replicate == 1,
        f"strategy.zero={zero} shards over strategy.dp_shard, which is 1 (dp_replicate={layout.dp_replicate}); "
        f"set strategy.dp_shard=-1 and strategy.dp_replicate=1 (or a size for each, for HSDP), or strategy.zero=0",
    )
    require(
        zero != 1 or (layout.tp == 1 and layout.pp == 1 and layout.dp_replicate == 1),
        f"strategy.zero=1 (ZeroRedundancyOptimizer over DDP) is not supported with tp={layout.tp}, pp={layout.pp}, "
        f"dp_replicate={layout.dp_replicate}: it needs a 1-D data-parallel mesh; use strategy.zero=2 or 3 to "
        f"combine sharding with other dims",
    )


DATA_PARALLEL = Parallelism(
    name="dp", dims=DIMS, sizes=sizes, defaults={"micro_batches": 1}, fields=fields, check=check
)
