"""Expert parallelism's layout (distrain/strategy/expert_parallel.py): what it refuses, the ranks it borrows, what
--plan says of it; and its all-to-alls (distrain/parallel/expert_parallel.py) measured by the traffic counter
(distrain/parallel/traffic.py) over one training step, forward and backward, of a tiny moe model on 4 gloo ranks
with ep 4: each rank sends and receives exactly what the step's routing says, and the record's estimate
(`alltoall_bytes`, which --plan prints) is near the ranks' mean. Its training is tests/test_moe.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import free_port, make_config, rank_env, spawn_ranks

from distrain.config import ConfigError
from distrain.driver.validation import validate

WORLD = 4
OVERRIDES = (
    "model=moe_nano",
    "model.dim=32",
    "model.n_layers=2",
    "model.ffn_dim=48",
    "model.moe.expert_dim=24",
    f"cluster.num_workers={WORLD}",
    f"strategy.ep={WORLD}",
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["strategy.ep=0"], "strategy.ep=0: must be at least 1"),
        (["strategy.ep=4"], "gradient group (dp_replicate × dp_shard × cp = 2), which it does not divide"),
        (["model=nano", "strategy.ep=2"], "strategy.ep=2 splits a mixture of experts, but model.moe.num_experts=0"),
        (["model.moe.num_experts=6", "cluster.num_workers=4", "strategy.ep=4"], "does not divide model.moe.num"),
        (["strategy=ps", "strategy.ep=2"], "does not combine with ps.mode=sync"),
        (["strategy=offload", "strategy.ep=2"], "does not combine with strategy.offload=cpu"),
        (["strategy.compile=true", "strategy.ep=2"], "does not combine with strategy.compile=true"),
    ],
)
def test_an_expert_parallel_layout_that_cannot_work_is_refused_in_one_line(tmp_path, overrides: list, says: str):
    with pytest.raises(ConfigError) as err:
        validate(make_config(tmp_path, "model=moe_nano", *overrides))
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.timeout(60)
def test_expert_parallelism_borrows_consecutive_ranks_of_the_gradient_group(tmp_path):
    """ep 2 on 4 DDP ranks: the world and the batch's shards as without it; ranks 0 and 2 hold the same experts
    (a replica of each other's state), 1 and 3 the others; --plan says each rank's share and its all-to-all bytes."""
    from distrain.driver.plan import describe, rank_memory
    from distrain.strategy.expert_parallel import alltoall_bytes

    cfg = make_config(tmp_path, "model=moe_nano", "cluster.num_workers=4", "strategy.ep=2")
    layout = validate(cfg)
    without = validate(make_config(tmp_path, "model=moe_nano", "cluster.num_workers=4"))
    assert layout.mesh_sizes() == without.mesh_sizes() and layout.data_shard(3) == without.data_shard(3)
    assert [layout.expert_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert layout.shard_of(0) == layout.shard_of(2) != layout.shard_of(1) == layout.shard_of(3)
    plan = describe(cfg, layout, None)
    assert "4 of 8 experts a layer" in plan and "expert parameters 147,456 of 294,912" in plan, plan
    assert "replica 0: ranks 0-1; replica 1: ranks 2-3" in plan, plan
    # 2 layers with experts; 8 sequences of 32 tokens over 4 ranks, 2 copies each of 32 values of 4 bytes, out and
    # back, forward and backward, half of it to the other rank
    assert alltoall_bytes(cfg, layout) == 2 * 64 * 2 * 32 * 4 * 2 * 2 / 2 and "sends 0.06 MiB per step" in plan
    # the memory estimate: half the experts' 294,912 weights on each rank, the other 25,248 whole (DDP)
    for estimate, experts in (
        (rank_memory(cfg, layout, 0, "fp32"), 294_912 // 2),
        (rank_memory(cfg, without, 0, "fp32"), 294_912),
    ):
        assert estimate.params == 4 * (25_248 + experts) and estimate.optimizer == 2 * estimate.params
    # under ZeRO-1 the other weights' moments are sharded over the 4 ranks, the experts' kept whole on each
    zero1 = make_config(tmp_path, "model=moe_nano", "cluster.num_workers=4", "strategy=zero1", "strategy.ep=2")
    assert rank_memory(zero1, validate(zero1), 0, "fp32").optimizer == 4 * 2 * (25_248 // 4 + 294_912 // 2)
    # under ZeRO-3 FSDP2 shards the rest over 4 and each rank's half of the experts over the 2 ranks holding it
    zero3 = make_config(tmp_path, "model=moe_nano", "cluster.num_workers=4", "strategy=zero3", "strategy.ep=2")
    estimate = rank_memory(zero3, validate(zero3), 0, "fp32")
    assert estimate.params == estimate.grads == 4 * (25_248 // 4 + 294_912 // 4), estimate
    assert "FSDP2 shards them over the 2 ranks holding the same experts (ep_rest): 73,728 each" in describe(
        zero3, validate(zero3), None
    )
    # HSDP shards them within a replica, so that a replica holds a rank's state: 2 × 4 with ep 2, over 2 ranks;
    # 2 × 2 with ep 2 leaves none (the experts whole, as under DDP)
    hsdp = (
        "model=moe_nano",
        "strategy=zero3",
        "strategy.dp_replicate=2",
        "strategy.ep=2",
        "trainer.micro_batch_size=1",
    )
    wide, narrow = (
        make_config(tmp_path, *hsdp, f"cluster.num_workers={2 * n}", f"strategy.dp_shard={n}") for n in (4, 2)
    )
    within = "2 ranks holding the same experts (ep_rest within a replica): 73,728 each"
    assert within in describe(wide, validate(wide), None)
    assert "the experts stay whole on their ranks" in describe(narrow, validate(narrow), None)
    assert rank_memory(narrow, validate(narrow), 0, "fp32").params == 4 * (25_248 // 2 + 294_912 // 2)


@pytest.mark.timeout(60)
def test_under_a_pipeline_each_stage_splits_its_own_blocks_experts(tmp_path):
    """pp 2 × dp 2 with ep 2 on 4: each stage's two dp ranks split the experts of its one block (of two), so --plan,
    the memory estimate and the all-to-all bytes count a stage's block alone."""
    from distrain.driver.plan import describe, rank_memory
    from distrain.strategy.expert_parallel import alltoall_bytes

    pp = ("model=moe_nano", "cluster.num_workers=4", "strategy=pp")
    cfg, without = make_config(tmp_path, *pp, "strategy.ep=2"), make_config(tmp_path, *pp)
    layout = validate(cfg)
    assert layout.sizes() == validate(without).sizes() == {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1}
    assert [layout.expert_rank(r) for r in range(4)] == [0, 1, 0, 1]  # ranks 0-1 stage 0, 2-3 stage 1
    plan = describe(cfg, layout, None)
    assert "4 of 8 experts a layer" in plan and "expert parameters 73,728 of 294,912" in plan, plan
    # 1 layer with experts on a rank; 8 sequences of 32 tokens over 2 ranks, as above otherwise
    assert alltoall_bytes(cfg, layout) == 1 * 128 * 2 * 32 * 4 * 2 * 2 / 2 and "sends 0.06 MiB per step" in plan
    for stage in (0, 1):  # ep 2 halves the 147,456 expert weights of the stage's block, and nothing else
        saved = (
            rank_memory(without, validate(without), stage, "fp32").params
            - rank_memory(cfg, layout, stage, "fp32").params
        )
        assert saved == 4 * 147_456 // 2


@pytest.mark.timeout(60)
def test_under_tensor_parallelism_each_tp_index_has_ep_groups_of_its_own(tmp_path):
    """tp 2 × ep 2 on 4 (dp 2, which ep borrows): ranks 0 and 1 (one tp group) hold the first half of the experts,
    2 and 3 the second; --plan says the tp ranks route the same tokens; the memory estimate keeps the experts and
    routers whole over tp (each rank half the experts by ep), the other matrices split by tp."""
    from distrain.driver.plan import describe, rank_memory

    cfg = make_config(tmp_path, "model=moe_nano", "cluster.num_workers=4", "strategy.tp=2", "strategy.ep=2")
    layout = validate(cfg)
    assert [layout.expert_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert "the tp=2 ranks of a group route the same tokens" in describe(cfg, layout, None)
    # of the 25,248 others: 24,576 in matrices (split by tp), the norms' 160, the routers' 2 · 32 · 8 whole
    assert rank_memory(cfg, layout, 0, "fp32").params == 4 * (24_576 // 2 + 160 + 512 + 294_912 // 2)
    tp_alone = make_config(tmp_path, "model=moe_nano", "cluster.num_workers=4", "strategy.tp=2")
    assert rank_memory(tp_alone, validate(tp_alone), 0, "fp32").params == 4 * (24_576 // 2 + 160 + 512 + 294_912)


def parallel_rank(rank: int, port: int, plain: dict, layout_dict: dict):  # noqa: ANN201
    """One spawned rank's config, its model laid out as the run would lay it out, and a draw of its own tokens."""
    rank_env(rank, WORLD, port, CUDA_VISIBLE_DEVICES="")
    import torch

    from distrain.config import from_plain
    from distrain.model.registry import build_model
    from distrain.parallel import process_group
    from distrain.parallel.parallelize import ParallelModel
    from distrain.strategy.layout import Layout
    from distrain.train.learner import cross_entropy

    device = process_group.init_from_env()
    cfg, layout = from_plain(plain), Layout.from_dict(layout_dict)
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.trainer.seq_len, seed=cfg.trainer.seed)
    parallel = ParallelModel(model, cfg.strategy, layout, device, False, cross_entropy)
    return cfg, parallel, torch.Generator().manual_seed(rank)  # each rank its own tokens, as its shard of a batch


def one_step(rank: int, port: int, plain: dict, layout_dict: dict, out: str) -> None:
    """One rank: a training step's forward and backward under the counter; its all-to-alls, and each layer's
    token copies per expert (its own tokens'), to a file."""
    import torch

    from distrain.model.moe import moe_layers
    from distrain.parallel import process_group
    from distrain.parallel.traffic import Traffic

    cfg, parallel, draw = parallel_rank(rank, port, plain, layout_dict)
    t = cfg.trainer
    tokens = torch.randint(0, cfg.model.vocab_size, (t.global_batch_size // WORLD, t.seq_len + 1), generator=draw)
    with Traffic() as traffic:
        parallel.forward_backward(tokens[:, :-1], tokens[:, 1:])
    figures = [layer.figures.tolist() for layer in moe_layers(parallel.module)]
    Path(out, f"rank{rank}.json").write_text(json.dumps({"ops": traffic.ops, "figures": figures}))
    process_group.destroy()


@pytest.mark.timeout(120)
def test_each_rank_sends_what_its_routing_says(tmp_path: Path):
    """Exact, to the byte, on every rank: per layer and forward, the per-expert counts (int64, ep·E/ep of them,
    the rank's own row staying) and, twice each way (out to the experts and back, then the gradients the same
    way), the rows this rank's tokens send to other ranks' experts and the rows other ranks' tokens send to its
    experts, dim fp32 values each. The estimate assumes an even spread, (ep − 1)/ep of the copies leaving a rank;
    an untrained router on random tokens spreads them nearly so: the rows' bytes, averaged over the ranks, are
    within 10% of it (measured: 1.005; each rank 0.96 to 1.05 of it)."""
    from distrain.config import to_plain
    from distrain.model.moe import FIGURES
    from distrain.strategy.expert_parallel import alltoall_bytes

    cfg = make_config(tmp_path, *OVERRIDES)
    layout = validate(cfg)
    spawn_ranks(one_step, (free_port(), to_plain(cfg), layout.as_dict(), str(tmp_path)), WORLD)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    experts, row = cfg.model.moe.num_experts, cfg.model.dim * 4
    local = experts // WORLD
    forwards = {f[-1] for rank in got for f in rank["figures"]}
    assert len(forwards) == 1 and len(FIGURES) == 4, "one count of forwards: the figures' last column"
    (forwards,) = forwards
    layers = len(got[0]["figures"])
    counts_bytes = layers * forwards * (WORLD - 1) * local * 8
    rows = []
    for r, rank in enumerate(got):
        mine = range(r * local, (r + 1) * local)
        out = sum(c for f in rank["figures"] for e, c in enumerate(f[:experts]) if e not in mine)
        into = sum(f[e] for s, other in enumerate(got) if s != r for f in other["figures"] for e in mine)
        rows.append(2 * (out + into) * row)  # each copy out and back, then its gradient the same way
        assert rank["ops"]["all_to_all"] == {
            "calls": layers * forwards * 5,  # the counts, the rows out and back; the rows' two again backward
            "sent": rows[-1] + counts_bytes,
            "received": rows[-1] + counts_bytes,
        }, f"rank {r}"
    ratio = sum(rows) / WORLD / alltoall_bytes(cfg, layout)
    assert 0.9 < ratio < 1.1, ratio


def expert_storage(rank: int, port: int, plain: dict, layout_dict: dict, out: str) -> None:
    """One rank of a ZeRO-3 run: each expert weight's local and full sizes and its placements, after one step's
    forward and backward (its gradient's local size too)."""
    import torch

    from distrain.model.moe import moe_layers
    from distrain.parallel import process_group

    cfg, parallel, draw = parallel_rank(rank, port, plain, layout_dict)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.trainer.seq_len + 1), generator=draw)
    parallel.forward_backward(tokens[:, :-1], tokens[:, 1:])
    weights = [p for layer in moe_layers(parallel.module) for p in layer.experts.parameters()]
    held = [[p.to_local().numel(), p.numel(), p.grad.to_local().numel(), str(p.placements)] for p in weights]
    Path(out, f"rank{rank}.json").write_text(json.dumps(held))
    process_group.destroy()


@pytest.mark.timeout(120)
def test_under_zero3_the_experts_are_sharded_over_the_ranks_holding_them(tmp_path: Path):
    """ZeRO-3 over 4 with ep 2: ep splits the experts in two and FSDP2 shards each half over ep_rest, the 2 ranks
    holding it, so a rank keeps a quarter of every expert weight and of its gradient (each expert's rows halved,
    its Shard(0) over ep kept whole)."""
    from distrain.config import to_plain

    cfg = make_config(tmp_path, *OVERRIDES[:-1], "strategy=zero3", "strategy.ep=2")
    layout = validate(cfg)
    spawn_ranks(expert_storage, (free_port(), to_plain(cfg), layout.as_dict(), str(tmp_path)), WORLD)
    for r in range(WORLD):
        held = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert len(held) == 2 * 3, held  # two layers with experts, three weights each
        for local, full, grad, placements in held:
            assert local * 4 == full and grad == local, (r, local, full, grad)
            assert placements == "(Shard(dim=1), Shard(dim=0))", placements
