"""Pipeline parallelism as the driver sees it: the schedules, the split into stages, its rules, its plan
section and the micro-batches in flight. Applied by distrain/parallel/pipeline.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distrain.config import TrainConfig
from distrain.strategy.layout import Layout
from distrain.strategy.parallelism import Parallelism, require


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


def fields(cfg: TrainConfig, sizes: dict[str, int]) -> dict[str, Any]:
    """The schedule, and the stages per rank: its default (2 for a multi-stage one) unless set."""
    s = cfg.strategy
    require(
        s.schedule in SCHEDULES,
        f"strategy.schedule={s.schedule!r} is not a known pipeline schedule; choose one of: {', '.join(SCHEDULES)}",
    )
    multi = SCHEDULES[s.schedule].multi_stage
    stages_per_rank = s.stages_per_rank if s.stages_per_rank is not None else (2 if multi else 1)
    return {"schedule": s.schedule, "stages_per_rank": stages_per_rank}


def check(cfg: TrainConfig, layout: Layout) -> None:
    require(layout.stages_per_rank >= 1, f"strategy.stages_per_rank={layout.stages_per_rank}: must be ≥ 1")
    if layout.pp == 1:
        return
    multi = SCHEDULES[layout.schedule].multi_stage
    require(
        multi or layout.stages_per_rank == 1,
        f"strategy.schedule={layout.schedule} runs one stage per rank; set strategy.stages_per_rank=1 "
        f"or choose interleaved_1f1b",
    )
    n_layers = cfg.model.n_layers
    require(
        layout.num_stages <= n_layers,
        f"strategy.pp × stages_per_rank = {layout.num_stages} stages but model.n_layers={n_layers}; "
        f"every stage needs a layer: lower strategy.pp or strategy.stages_per_rank",
    )
    m = layout.micro_batches
    require(
        m >= layout.pp and (not multi or m % layout.pp == 0),
        f"strategy.schedule={layout.schedule} on strategy.pp={layout.pp} needs {'a multiple of ' if multi else ''}"
        f"at least {layout.pp} micro-batches per step, but trainer.global_batch_size / (micro_batch_size × "
        f"data-parallel size) = {m}; raise trainer.global_batch_size or lower trainer.micro_batch_size",
    )


def in_flight(layout: Layout, pp_rank: int) -> int:
    """Micro-batches whose activations a rank holds at once: one without a pipeline (gradient
    accumulation runs them one after another); all of them for GPipe-like schedules; for the 1F1B
    family the pp − pp_rank of the warm-up (Narayanan et al. 2021), taken as is for the interleaved ones."""
    if layout.pp == 1:
        return 1
    n = layout.micro_batches
    return n if SCHEDULES[layout.schedule].all_at_once else min(n, layout.pp - pp_rank)


def _layers(r: range) -> str:
    return f"layer {r.start}" if len(r) == 1 else f"layers {r.start}-{r.stop - 1}"


def plan(cfg: TrainConfig, layout: Layout) -> list[str]:
    if layout.pp == 1:
        return []
    stages = layout.num_stages
    lines = [f"pipeline ({layout.schedule}, {stages} stages, {layout.micro_batches} micro-batches per step):"]
    for pp_rank in range(layout.pp):
        for i in layout.stages(pp_rank):
            parts = ["embedding"] if i == 0 else []
            parts.append(_layers(stage_layers(cfg.model.n_layers, stages)[i]))
            parts += ["norm", "output"] if i == stages - 1 else []
            lines.append(f"  stage {i} on pp rank {pp_rank}: {', '.join(parts)}")
    return lines


PIPELINE = Parallelism(
    name="pp",
    dims=("pp",),
    defaults={"stages_per_rank": 1, "schedule": "1f1b"},
    fields=fields,
    check=check,
    plan=plan,
)
