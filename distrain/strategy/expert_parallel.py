"""Expert parallelism as the driver sees it: `strategy.ep` ranks split each mixture-of-experts layer's experts,
num_experts / ep each, and send every token to its experts' ranks and back (two all-to-alls a layer, and two in
the backward). Applied by distrain/parallel/expert_parallel.py.

EP borrows its ranks from the gradient group (dp_replicate × dp_shard × cp, ep innermost: consecutive ranks of
the group), as torchtitan's dp2ep borrows dp_shard × cp, and adds no dim to the mesh. The experts are the only
weights it splits: attention and the dense weights stay replicated (or sharded) over the whole gradient group,
whose ranks keep their different tokens, so the batch, the world size and every other parallelism's sizes stay
as they were and no rank idles beside the experts. A rank's expert gradients are summed over the ranks holding
the same experts (`ep_rest`) and scaled as the rest of the gradient is, by the whole group. Under 1-D tensor
parallelism every rank of a tensor-parallel group routes the same tokens (distrain/model/moe.py, moe_tp_plan):
each tp index has ep groups of its own, which exchange the same rows, and the experts are not split over tp.

Under a pipeline the world is pp × the gradient group, so the ranks an ep group borrows hold one stage: each
stage's experts are split over its own ranks, and every rank of an ep group runs the same schedule, so their
all-to-alls come in the same order (forward, backward, a recomputed forward alike). Under ZeRO-1 the experts
get an optimizer of their own beside ZeroRedundancyOptimizer, which steps each weight on one rank of the group
and sends it to the others (it would overwrite every ep rank's experts with one rank's): their state is whole
on each rank holding them, already 1/ep of the experts', and not sharded further over `ep_rest`.

Under ZeRO-2/3 FSDP2 shards each rank's experts over the ranks of `ep_rest` within a replica (all of them without
HSDP's dp_replicate; `expert_shard_ranks`), as torchtitan's dp_mod_ep does: units of their own, before the blocks',
whose gradients FSDP2 reduce-scatters there and divides by the whole group's width. HSDP's replicas hold the same
shards (recovery takes a rank's state from one). Where ep leaves no rank of a replica (ep takes all of dp_shard ×
cp, or does not divide it) the experts stay whole, outside FSDP2, as under DDP."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from distrain.config import TrainConfig
from distrain.model.families import shipped
from distrain.strategy.layout import Layout
from distrain.strategy.parallelism import Parallelism, require
from distrain.strategy.pipeline import stage_layers


def fields(cfg: TrainConfig, sizes: dict[str, int]) -> dict[str, Any]:
    ep = cfg.strategy.ep
    require(ep >= 1, f"strategy.ep={ep}: must be at least 1 (1: every rank holds every expert)")
    return {"ep": ep}


def check(cfg: TrainConfig, layout: Layout) -> None:
    """On every layout the run may take (an elastic run's smaller ones too): EP borrows ranks of the gradient group."""
    if layout.ep == 1:
        return
    ep, width = f"strategy.ep={layout.ep}", layout.gradient_width
    require(
        width % layout.ep == 0,
        f"{ep} borrows ranks of the gradient group (dp_replicate × dp_shard × cp = {width}), which it does not "
        f"divide; choose an ep that divides {width}",
    )


def validate(cfg: TrainConfig) -> None:
    """The model and the strategy settings EP needs."""
    s, m = cfg.strategy, cfg.model.moe
    if s.ep == 1:
        return
    ep = f"strategy.ep={s.ep}"
    require(m.num_experts >= 1, f"{ep} splits a mixture of experts, but model.moe.num_experts=0; use model=moe_nano")
    require(
        m.num_experts % s.ep == 0,
        f"{ep} does not divide model.moe.num_experts={m.num_experts}; choose an ep that divides it",
    )
    refused = (
        (cfg.ps.mode is None, f"ps.mode={cfg.ps.mode}", "a parameter-server worker holds every expert"),
        (s.offload == "none", f"strategy.offload={s.offload}", "the experts stay outside FSDP2, which offloads"),
        (not s.compile, "strategy.compile=true", "the all-to-all's split sizes are read on the host"),
    )
    for ok, setting, why in refused:
        require(ok, f"{ep} does not combine with {setting} ({why}); leave it out, or set strategy.ep=1")


def expert_shard_ranks(layout: Layout) -> int:
    """Over how many ranks ZeRO-2/3's FSDP2 shards each rank's experts: those of `ep_rest` within one replica of
    HSDP (dp_shard × cp over ep; all of ep_rest without dp_replicate), whose replicas then hold the same shards as
    recovery expects; 1 (the experts whole on their ranks) where ep does not divide them."""
    within = layout.gradient_width // layout.dp_replicate
    return within // layout.ep if within % layout.ep == 0 else 1


def expert_params(cfg: TrainConfig, blocks: Iterable[int] | None = None, routers: bool = False) -> int:
    """The experts' parameters of `blocks` (the whole model's by default): every routed expert of each block with
    experts, and with `routers` its router (what 1-D tensor parallelism leaves whole)."""
    m, c = cfg.model.moe, cfg.model
    each = 3 * c.dim * (m.expert_dim or c.ffn_dim) * m.num_experts + (c.dim * m.num_experts if routers else 0)
    return sum(each for b in (range(c.n_layers) if blocks is None else blocks) if m.is_sparse(b))


def rank_blocks(cfg: TrainConfig, layout: Layout, pp_rank: int) -> list[int]:
    """The blocks the ranks at `pp_rank` hold: those of its pipeline stages (all of them without a pipeline)."""
    per_stage = stage_layers(cfg.model.n_layers, layout.num_stages)
    return [b for stage in layout.stages(pp_rank) for b in per_stage[stage]]


def alltoall_bytes(cfg: TrainConfig, layout: Layout) -> float:
    """Bytes one rank sends per step in the all-to-alls: each layer with experts sends its tokens' top_k copies
    (dim values each) out and back in the forward, and their gradients in the backward, of which the (ep − 1)/ep
    bound for other ranks leave it. Under a pipeline, a rank of the stages with the most such layers."""
    c, t = cfg.model, cfg.trainer
    tokens = t.global_batch_size * t.seq_len // layout.gradient_width
    element = 2 if t.precision == "bf16" else 4  # auto: as on a CPU (fp32) unless told
    layers = max(sum(map(c.moe.is_sparse, rank_blocks(cfg, layout, r))) for r in range(layout.pp))
    return layers * tokens * c.moe.top_k * c.dim * element * 2 * 2 * (layout.ep - 1) / layout.ep


def plan_lines(cfg: TrainConfig, layout: Layout) -> list[str]:
    if layout.ep == 1:
        return []
    m, experts = cfg.model.moe, expert_params(cfg)
    family = shipped(cfg.model._target_)
    rest = family.matmul_weights(cfg.model) + family.other_params(cfg.model) - experts if family else None
    held = f"{m.num_experts // layout.ep} of {m.num_experts} experts a layer"
    # under a pipeline, a rank of the stages with the most of them
    mine = max(expert_params(cfg, rank_blocks(cfg, layout, r)) for r in range(layout.pp)) // layout.ep
    lines = [
        f"expert parallel: ep={layout.ep} consecutive ranks of each gradient group of {layout.gradient_width} "
        f"split the experts, {held}",
        f"  each rank: expert parameters {mine:,} of {experts:,}"
        + (f"; the other {rest:,} as the other parallelisms hold them" if rest is not None else ""),
        f"  each rank sends {alltoall_bytes(cfg, layout) / 2**20:.2f} MiB per step in the all-to-alls "
        f"(forward and backward)",
    ]
    shards, zero = expert_shard_ranks(layout), cfg.strategy.zero
    if zero >= 2 and shards > 1:
        lines.append(
            f"  ZeRO-{zero}: FSDP2 shards them over the {shards} ranks holding the same experts (ep_rest"
            + (" within a replica" if layout.dp_replicate > 1 else "")
            + f"): {-(-mine // shards):,} each"
        )
    elif zero >= 2:
        lines.append(f"  ZeRO-{zero}: the experts stay whole on their ranks (no other rank of a replica holds them)")
    if layout.tp > 1:
        lines.append(
            f"  tensor parallel: the tp={layout.tp} ranks of a group route the same tokens, each tp index with ep "
            f"groups of its own; the experts are not split over tp (each rank computes its share whole)"
        )
    return lines


EXPERT_PARALLEL = Parallelism(
    name="ep", dims=(), defaults={"ep": 1}, fields=fields, check=check, validate=validate, plan_lines=plan_lines
)
