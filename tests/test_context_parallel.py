"""Context parallelism (distrain/parallel/context_parallel.py, ring_attention.py): 10 steps of every layout
below, on 4 gloo ranks in one spawn, give the loss and gradient norm of the same 10 steps in one process to
1e-4 (Llama with grouped-query attention and GPT-2 with learned positions; ring and all-to-all; alone, beside
data parallelism (DDP, FSDP2 over dp_shard × cp), tensor and pipeline parallelism). The same spawn counts what
a rank sends per layer and what it keeps for the backward, against theory and the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port, make_config, rank_env

WORLD = 4
STEPS = 10
TOL = 1e-4
LLAMA = ("model.n_heads=4", "model.n_kv_heads=2")  # grouped-query: K/V heads travel, each serving two
GPT2 = ("model=gpt2_nano", "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=64")
CASES = {
    # id: (model, strategy overrides); every case on 4 ranks
    "cp4_ring_llama": (LLAMA, ("strategy.cp=4",)),
    "cp4_alltoall_gpt2": (GPT2, ("strategy.cp=4", "strategy.cp_mode=alltoall")),
    "cp4_alltoall_llama": (("model.n_heads=4",), ("strategy.cp=4", "strategy.cp_mode=alltoall")),
    "dp2_cp2_ring_gpt2": (GPT2, ("strategy.cp=2",)),
    "dp2_cp2_alltoall_llama": (LLAMA, ("strategy.cp=2", "strategy.cp_mode=alltoall")),
    "zero3_dp2_cp2_ring_llama": (LLAMA, ("strategy=zero3", "strategy.cp=2")),
    "cp2_tp2_ring_llama": (LLAMA, ("strategy=tp", "strategy.cp=2")),
    "cp2_tp2_alltoall_gpt2": (GPT2, ("strategy=tp", "strategy.cp=2", "strategy.cp_mode=alltoall")),
    "cp2_pp2_ring_gpt2": (GPT2, ("strategy=pp", "strategy.cp=2")),
}


def batches(cfg) -> list[torch.Tensor]:
    """STEPS global batches of random tokens (seq_len + 1 each: inputs and shifted targets)."""
    g = torch.Generator().manual_seed(0)
    t = cfg.trainer
    return [torch.randint(0, 256, (t.global_batch_size, t.seq_len + 1), generator=g) for _ in range(STEPS)]


def train_steps(parallel, layout, data, shard: tuple[int, int]) -> tuple[list[torch.Tensor], list[float]]:
    """STEPS steps of AdamW: the rank's summed micro-batch losses (local) and the gradient norms."""
    optimizer = torch.optim.AdamW(parallel.module.parameters(), lr=1e-2)
    losses, norms = [], []
    for batch in data:
        rows = batch.chunk(shard[1])[shard[0]]
        losses.append(parallel.forward_backward(rows[:, :-1], rows[:, 1:]))
        norms.append(float(parallel.clip_grad_norm(1.0)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, norms


def rank_main(rank: int, port: int, cases: dict, out: str) -> None:
    rank_env(rank, WORLD, port, CUDA_VISIBLE_DEVICES="")
    import torch.distributed as dist

    from distrain.config import from_plain
    from distrain.model.registry import build_model
    from distrain.parallel import process_group
    from distrain.parallel.parallelize import ParallelModel
    from distrain.strategy.layout import Layout
    from distrain.train.learner import cross_entropy

    device = process_group.init_from_env()
    results = {}
    for name, (plain, layout_dict) in cases.items():
        cfg, layout = from_plain(plain), Layout.from_dict(layout_dict)
        with torch.device("meta"):
            model = build_model(cfg.model, cfg.trainer.seq_len, seed=cfg.trainer.seed)
        parallel = ParallelModel(model, cfg.strategy, layout, device, False, cross_entropy)
        losses, norms = train_steps(parallel, layout, batches(cfg), layout.data_shard(rank))
        total = torch.stack(losses)
        dist.all_reduce(total)  # the loop's global mean: every loss holder's local means, summed
        results[name] = {"loss": (total / (layout.micro_batches * layout.loss_holders)).tolist(), "grad_norm": norms}
    if rank == 0:
        torch.save(results, Path(out, "results.pt"))
    process_group.destroy()


def reference(cfg) -> dict[str, list[float]]:
    """The same steps in this process, the whole model, no process group."""
    from distrain.model.registry import build_model
    from distrain.parallel.parallelize import ParallelModel
    from distrain.strategy.layout import Layout
    from distrain.train.learner import cross_entropy

    layout = Layout.single(cfg.trainer.global_batch_size // cfg.trainer.micro_batch_size)
    model = build_model(cfg.model, cfg.trainer.seq_len, seed=cfg.trainer.seed)
    parallel = ParallelModel(model, cfg.strategy, layout, torch.device("cpu"), False, cross_entropy, collective=False)
    losses, norms = train_steps(parallel, layout, batches(cfg), (0, 1))
    return {"loss": [float(x) / layout.micro_batches for x in losses], "grad_norm": norms}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from distrain.config import to_plain
    from distrain.driver.validation import validate

    tmp = tmp_path_factory.mktemp("cp")
    cases, refs = {}, {}
    for name, (model, strategy) in CASES.items():
        cfg = make_config(tmp, f"cluster.num_workers={WORLD}", *model, *strategy)
        cases[name] = (to_plain(cfg), validate(cfg).as_dict())
        if model not in refs:
            refs[model] = reference(make_config(tmp, "cluster.num_workers=1", *model))
    mp.spawn(rank_main, args=(free_port(), cases, str(tmp)), nprocs=WORLD)
    got = torch.load(tmp / "results.pt")
    return {name: (got[name], refs[CASES[name][0]]) for name in CASES}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_context_parallel_matches_one_process(case: str, runs):
    got, want = runs[case]
    for key in ("loss", "grad_norm"):
        for step, (a, b) in enumerate(zip(got[key], want[key], strict=True), 1):
            assert a == pytest.approx(b, rel=TOL, abs=TOL), f"{case}: {key} at step {step}: {a} vs {b}"
