"""The torch.distributed layer without Ray: mesh, layout arithmetic, DDP's skipped all-reduce,
gradient clipping, pipeline stages that keep the full model's parameter names, models materialised
already sharded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port, make_config, rank_env
from torch import nn

from distrain.config import ModelConfig, StrategyConfig
from distrain.model.llama import Transformer
from distrain.parallel.parallelize import ParallelModel
from distrain.strategy.layout import Layout
from distrain.strategy.pipeline import stage_layers
from distrain.strategy.resolve import layout_of, resolve, single
from distrain.train.learner import cross_entropy


def test_a_layout_fills_the_open_dim_and_lays_ranks_out_row_major(tmp_path):
    from conftest import make_config

    cfg = make_config(tmp_path, "strategy=pp", "strategy.tp=2", "cluster.num_workers=8", "trainer.global_batch_size=16")
    layout = resolve(cfg)
    assert layout == layout_of(pp=2, dp_replicate=2, dp_shard=1, tp=2, micro_batches=4)
    assert layout.coordinate(5) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert [layout.data_shard(r) for r in (0, 2, 5, 6)] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # neighbours: one node each
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(
    ("layers", "stages", "expected"),
    [
        (4, 2, [2, 2]),  # embedding + 2 blocks | 2 blocks + head
        (6, 4, [1, 2, 2, 1]),  # the end stages carry the embedding and the head
        (8, 4, [2, 2, 2, 2]),  # ties go to the stage with fewer blocks
        (8, 8, [1] * 8),
        (5, 1, [5]),
    ],
)
def test_stages_are_balanced_counting_embedding_and_head(layers: int, stages: int, expected: list[int]):
    split = stage_layers(layers, stages)
    assert [len(r) for r in split] == expected
    assert [i for r in split for i in r] == list(range(layers))  # contiguous, each block once


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="3 layers into 4 stages"):
        stage_layers(3, 4)


def test_interleaved_stages_loop_over_the_ranks():
    assert layout_of(pp=2, dp_replicate=1, dp_shard=1, tp=1, stages_per_rank=2).stages(1) == [1, 3]


@pytest.fixture
def ddp(process_group) -> ParallelModel:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    layout = single(micro_batches=3)
    return ParallelModel(model, StrategyConfig(), layout, torch.device("cpu"), False, nn.functional.mse_loss)


def test_no_sync_skips_the_all_reduce_until_the_last_micro_batch(ddp: ParallelModel):
    reductions: list[int] = []

    def count_and_pass(state, bucket):
        reductions.append(1)
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp.module.register_comm_hook(None, count_and_pass)
    for i in range(3):
        with ddp.no_sync(last=i == 2):
            ddp.module(torch.randn(4, 8)).sum().backward()
        assert bool(reductions) == (i == 2), f"micro-batch {i}"


def test_clip_grad_norm_reports_the_norm_before_clipping(ddp: ParallelModel):
    ddp.module(torch.randn(4, 8)).sum().mul(100).backward()
    before = torch.cat([p.grad.flatten() for p in ddp.module.parameters()]).norm()
    reported = ddp.clip_grad_norm(max_norm=1.0)
    after = torch.cat([p.grad.flatten() for p in ddp.module.parameters()]).norm()
    assert reported == pytest.approx(before.item(), rel=1e-6)
    assert after == pytest.approx(1.0, rel=1e-5)
    assert ddp.clip_grad_norm(max_norm=0.0) == pytest.approx(1.0, rel=1e-5)  # 0: measure only


def test_micro_batches_average_to_the_whole_batch_gradient(process_group):
    """forward_backward over 4 micro-batches leaves the gradient of the mean loss of the batch."""
    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, ffn_dim=32)
    torch.manual_seed(0)
    whole, split = Transformer(cfg, 8), Transformer(cfg, 8)
    split.load_state_dict(whole.state_dict())
    x = torch.randint(0, 256, (8, 8))
    cross_entropy(whole(x), x).backward()
    parallel = ParallelModel(split, StrategyConfig(), single(4), torch.device("cpu"), False, cross_entropy)
    loss_sum = parallel.forward_backward(x, x)
    assert loss_sum / 4 == pytest.approx(cross_entropy(whole(x), x).item(), rel=1e-5)
    for (name, a), b in zip(whole.named_parameters(), parallel.module.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_fsdp_reduces_gradients_only_after_the_last_micro_batch(process_group):
    """Under FSDP2 a skipped reduce-scatter leaves the sharded gradients unset; the micro-batch's
    gradient waits, unsharded and local, and the last micro-batch reduces the sum of both at once."""
    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, ffn_dim=32)
    torch.manual_seed(0)
    reference, model = Transformer(cfg, 8), Transformer(cfg, 8)
    model.load_state_dict(reference.state_dict())
    fsdp = ParallelModel(model, StrategyConfig(zero=3), single(2), torch.device("cpu"), False, cross_entropy)
    x1, x2 = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    with fsdp.no_sync(last=False):
        cross_entropy(fsdp.module(x1), x1).backward()
    assert all(p.grad is None for p in fsdp.module.parameters())
    with fsdp.no_sync(last=True):
        cross_entropy(fsdp.module(x2), x2).backward()
    (cross_entropy(reference(x1), x1) + cross_entropy(reference(x2), x2)).backward()
    for (name, want), got in zip(reference.named_parameters(), fsdp.module.parameters(), strict=True):
        torch.testing.assert_close(got.grad.full_tensor(), want.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_every_schedule_name_has_a_torch_schedule():
    from distrain.parallel.pipeline import SCHEDULE_CLASSES
    from distrain.strategy.pipeline import SCHEDULES

    assert SCHEDULE_CLASSES.keys() == SCHEDULES.keys()
    for name, schedule in SCHEDULES.items():
        multi = issubclass(SCHEDULE_CLASSES[name], torch.distributed.pipelining.schedules.PipelineScheduleMulti)
        assert multi == schedule.multi_stage, name


def test_every_parallelism_the_driver_knows_is_applied_in_torchtitans_order():
    """The driver's registry and the torch layer's steps name the same parallelisms (the pipeline is no
    step: it makes the parts), laid on the mesh and applied in the order they always were; float8's conversion
    first, so that the parallelisms lay out and shard the converted modules."""
    from distrain.parallel.parallelize import PASSES
    from distrain.strategy import MESH_DIMS, PARALLELISMS

    assert MESH_DIMS == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert {p.name for p in PARALLELISMS} - PASSES.keys() == {"pp"}
    assert list(PASSES) == ["float8", "cp", "tp", "ep", "activation_checkpoint", "compile", "dp"]


WORLD = 4
# Sizes that split unevenly: 4 FSDP2 shards of 50 rows, 2 of the 25 rows a tensor-parallel rank holds.
UNEVEN = ("model.dim=36", "model.ffn_dim=50")
# name → overrides: each rank's Learner weights, gathered, must equal the whole model's.
SHARDED = {
    "zero3": ("strategy=zero3",),  # Shard(0) over 4
    "tp": ("strategy=tp",),  # tp=2 × dp_replicate=2
    "fsdp_tp": ("strategy=fsdp_tp",),  # tp=2 × dp_shard=2: 2-D DTensors
    "pp": ("strategy=pp",),  # pp=2 × dp_replicate=2: each stage its part
}
# A model whose whole fp32 weights (330 MB) dwarf a ZeRO-3 rank's share (82 MB) and its largest matrix (3 MB).
LARGE = ("model.dim=512", "model.n_layers=24", "model.n_heads=8", "model.ffn_dim=1536")


def rss(field: str) -> int:
    """This process's VmRSS (now) or VmHWM (peak) in bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def build_learners(rank: int, port: int, large: tuple, cases: dict, out: str) -> None:
    """One rank: each case's Learner's weights, gathered whole, and the peak memory a ZeRO-3 Learner
    of the large model adds while it is built, saved to a file."""
    rank_env(rank, WORLD, port, CUDA_VISIBLE_DEVICES="")
    from distrain.config import from_plain
    from distrain.parallel import process_group
    from distrain.parallel.parallelize import as_tensor
    from distrain.train.faults import Faults
    from distrain.train.learner import Learner

    device = process_group.init_from_env()

    def learner(plain: dict, layout: dict) -> Learner:
        cfg, layout = from_plain(plain), Layout.from_dict(layout)
        return Learner(cfg, layout, layout.data_shard(rank), device, Faults(cfg.fault, rank, None))

    weights = {
        name: {key: as_tensor(p.detach()) for key, p in learner(*case).module.named_parameters()}
        for name, case in cases.items()
    }
    before = rss("VmRSS")  # after the small cases: what a first Learner imports is not counted
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    learner(*large)
    grown = rss("VmHWM") - before
    torch.save({"grown": grown, "weights": weights}, Path(out, f"rank{rank}.pt"))
    process_group.destroy()


@pytest.mark.timeout(300)
def test_learners_materialise_their_shards_of_the_whole_models_weights(tmp_path: Path):
    """A Learner builds its model on the meta device and materialises only its shards: under ZeRO-3
    on 4 ranks a rank's memory grows by its quarter of the model and one full matrix at a time,
    never by the whole model; and under every layout the shards, gathered, are exactly the weights
    of the model built whole with the same seed (uneven shards and 2-D DTensors included)."""
    from distrain.config import to_plain
    from distrain.driver.validation import validate
    from distrain.model.size import num_params

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 500)

    def case(*overrides: str) -> tuple:
        cfg = make_config(tmp_path, f"cluster.num_workers={WORLD}", f"data.path={tmp_path / 'corpus'}", *overrides)
        return to_plain(cfg), validate(cfg).as_dict()

    large = case("strategy=zero3", *LARGE)
    cases = {name: case(*UNEVEN, "trainer.seed=5", *overrides) for name, overrides in SHARDED.items()}
    mp.spawn(build_learners, args=(free_port(), large, cases, str(tmp_path)), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]

    whole_bytes = 4 * num_params(make_config(tmp_path, *LARGE).model)
    for rank, got in enumerate(ranks):
        assert got["grown"] < whole_bytes / 2, (
            f"rank {rank} grew by {got['grown']} B; the whole model is {whole_bytes} B"
        )

    cfg = make_config(tmp_path, *UNEVEN)
    want = Transformer(cfg.model, cfg.trainer.seq_len, seed=5).state_dict()
    for name in SHARDED:
        seen = set()
        for rank, got in enumerate(ranks):
            for key, value in got["weights"][name].items():
                torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=f"{name} rank {rank} {key}")
                seen.add(key)
        assert seen == set(want), name
