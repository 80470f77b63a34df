"""Float8 training (trainer.float8; distrain/strategy/float8.py, distrain/parallel/float8.py), emulated on CPU.

Parity, STEPS AdamW steps of the tiny Llama on one learnable batch stream:
- float8 against the same run in fp32, one process: the loss within F8_RTOL relative at every step. e4m3 keeps 3
  mantissa bits, so one cast is exact to 2^-4 = 6.25% relative; a matmul's K products round independently, and
  their errors average out in the sum (~2^-4/√K), and the loss, a mean over every token, averages them again. A
  conversion that broke the numbers (a wrong scale: a factor on every product) moves the loss by whole percents;
  float8 on this model moved it by at most 0.7%.
- FSDP2 (ZeRO-3 over 2 ranks, the weights all-gathered in float8) and 1-D TP over 2 ranks against the same recipe
  in one process: DIST_TOL absolute, as the other layouts' parities (tensorwise scales are the whole tensor's
  amax, the same however it is sharded; each float8 value is then the same, and only the fp32 sums' order
  differs).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port, make_config, rank_env, spawn_ranks
from torch import nn

from distrain.config import ConfigError
from distrain.driver.plan import describe
from distrain.driver.validation import validate
from distrain.strategy.float8 import Float8Unsupported, check_gpu, kept

STEPS = 3
F8_RTOL = 0.02
DIST_TOL = 1e-5
SMALL = ("trainer.global_batch_size=4", "trainer.micro_batch_size=2")  # emulated float8 is slow: few rows
WORLD = 2
RECIPES = ("none", "tensorwise", "rowwise")
DISTRIBUTED = {  # case → (recipe, overrides) on WORLD ranks
    "zero3_tensorwise": ("tensorwise", ("strategy=zero3",)),
    "tp2_tensorwise": ("tensorwise", ("strategy=tp",)),
    "tp2_rowwise": ("rowwise", ("strategy=tp",)),
}
# Every block's projections: what the rule converts in the tiny Llama (dims 32 and 64); the head stays.
BLOCK = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
         "feed_forward.w3")  # fmt: skip


def test_the_rule_converts_aligned_linears_but_the_head_and_routers():
    outputs = ("norm", "output")
    assert kept("layers.0.attention.wq", 32, 64, outputs) is None
    assert kept("output", 32, 256, outputs) == "the head"
    assert kept("layers.1.feed_forward.router", 32, 16, outputs) == "a router"
    assert kept("layers.0.feed_forward.w1", 32, 40, outputs) == "32×40: a dim not divisible by 16"


def test_a_gpu_without_float8_tensor_cores_is_refused_in_one_line():
    """The capability check takes the capability, so a CPU run feeds an A100's (8.0) and sees the refusal."""
    with pytest.raises(Float8Unsupported) as refused:
        check_gpu((8, 0), "NVIDIA A100-SXM4-80GB")
    assert str(refused.value) == (
        "trainer.float8 needs float8 tensor cores (compute capability ≥ 8.9: Ada, Hopper or later); "
        "NVIDIA A100-SXM4-80GB has 8.0: set trainer.float8=none on this GPU"
    )
    assert Float8Unsupported.permanent  # the supervisor ends the run at once: every attempt has the same GPU
    with pytest.raises(Float8Unsupported):
        check_gpu((8, 6), "RTX 3090")
    for capability in ((8, 9), (9, 0), (10, 0)):  # Ada, Hopper, Blackwell
        check_gpu(capability, "GPU")


def test_bad_float8_settings_are_refused_before_anything_starts(tmp_path: Path, monkeypatch):
    with pytest.raises(ConfigError, match="trainer.float8='e4m3': choose none, tensorwise, rowwise"):
        validate(make_config(tmp_path, "trainer.float8=e4m3"))
    grid = ("cluster.num_workers=4", "strategy=tp2d", "trainer.float8=rowwise")
    with pytest.raises(ConfigError, match="strategy.tp_mode=2d: the grid layers compute their own matmuls"):
        validate(make_config(tmp_path, *grid))
    monkeypatch.setitem(sys.modules, "torchao", None)  # how Python marks a package as not importable
    with pytest.raises(ConfigError, match=r"needs torchao, which is not installed: pip install 'distrain\[float8\]'"):
        validate(make_config(tmp_path, "trainer.float8=tensorwise"))


def test_the_plan_lists_the_converted_modules(tmp_path: Path):
    cfg = make_config(tmp_path, "cluster.num_workers=2", "strategy=zero3", "trainer.float8=tensorwise")
    lines = describe(cfg, validate(cfg), None, gpu=False).splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("float8 ("))
    assert lines[first] == (
        "float8 (tensorwise scaling, emulated on the CPU: a GPU run's numbers, FSDP2 all-gathers the converted "
        "weights in float8): 14 of 15 nn.Linear converted (torchao)"
    )
    assert lines[first + 1 : first + 9] == [*(f"  {name} in blocks 0-1" for name in BLOCK),
                                            "  kept in high precision: output (the head)"]  # fmt: skip
    both = make_config(tmp_path, "cluster.num_workers=4", "strategy=fsdp_tp", "trainer.float8=tensorwise")
    line = next(x for x in describe(both, validate(both), None, gpu=True).splitlines() if x.startswith("float8 ("))
    assert line.startswith("float8 (tensorwise scaling, float8 tensor cores (torch._scaled_mm)): 14 of 15"), line
    moe = ("model=moe_nano", "model.n_layers=3", "model.moe.shared_experts=1", "model.moe.first_dense=1")
    cfg = make_config(tmp_path, *moe, "trainer.float8=rowwise")
    lines = describe(cfg, validate(cfg), None, gpu=True).splitlines()
    head = "float8 (rowwise scaling, float8 tensor cores (torch._scaled_mm)): 21 of 24 nn.Linear converted (torchao)"
    assert head in lines
    assert {"  feed_forward.w2 in block 0", "  feed_forward.shared.w2 in blocks 1-2"} < set(lines)
    assert "  kept in high precision: feed_forward.router in blocks 1-2 (a router)" in lines


def batches() -> list[torch.Tensor]:
    """STEPS batches of 4 rows counting up from a random start: learnable, so the loss falls."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (4, 1), generator=g) + torch.arange(33)) % 256 for _ in range(STEPS)]


def built(recipe: str, storage: Path, *overrides: str, collective: bool = False, device=None):  # noqa: ANN001, ANN201
    """A ParallelModel as a Learner builds it (on the meta device, then laid out), and its layout."""
    from distrain.model.registry import build_model
    from distrain.parallel.parallelize import ParallelModel
    from distrain.train.learner import cross_entropy

    cfg = make_config(storage, f"cluster.num_workers={WORLD if collective else 1}", f"trainer.float8={recipe}",
                      *SMALL, *overrides)  # fmt: skip
    layout = validate(cfg)
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.trainer.seq_len, seed=cfg.trainer.seed)
    device = device or torch.device("cpu")
    return ParallelModel(model, cfg.strategy, layout, device, False, cross_entropy, collective, float8=recipe), layout


def train(parallel, shard: tuple[int, int] = (0, 1)) -> tuple[list[torch.Tensor], list[float], torch.optim.AdamW]:  # noqa: ANN001
    """STEPS steps of AdamW: the rank's summed micro-batch losses, the gradient norms and the optimizer."""
    optimizer = torch.optim.AdamW(parallel.module.parameters(), lr=1e-2)
    losses, norms = [], []
    for batch in batches():
        rows = batch.chunk(shard[1])[shard[0]]
        losses.append(parallel.forward_backward(rows[:, :-1], rows[:, 1:]).detach())
        norms.append(float(parallel.clip_grad_norm(1.0)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, norms, optimizer


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """Each recipe's STEPS in one process: the mean losses, the gradient norms, the modules' types."""
    runs = {}
    for recipe in RECIPES:
        parallel, layout = built(recipe, tmp_path_factory.mktemp(recipe))
        losses, norms, _ = train(parallel)
        types = {name: type(m).__name__ for name, m in parallel.module.named_modules() if isinstance(m, nn.Linear)}
        runs[recipe] = {"loss": [float(x) / layout.micro_batches for x in losses], "grad_norm": norms, "types": types}
    return runs


def test_float8_converts_the_blocks_and_trains_as_fp32_does(one_process: dict):
    want = {f"layers.{b}.{name}" for b in (0, 1) for name in BLOCK}
    fp32 = one_process["none"]["loss"]
    assert fp32[-1] < fp32[0] - 0.1, fp32  # it learns
    for recipe in ("tensorwise", "rowwise"):
        run = one_process[recipe]
        assert {n for n, t in run["types"].items() if t == "Float8Linear"} == want, recipe
        assert run["types"]["output"] == "Linear"
        assert run["loss"] != fp32, f"{recipe}: the same numbers as fp32, nothing computed in float8"
        torch.testing.assert_close(torch.tensor(run["loss"]), torch.tensor(fp32), rtol=F8_RTOL, atol=0, msg=recipe)


def rank_main(rank: int, port: int, root: str) -> None:
    rank_env(rank, WORLD, port, CUDA_VISIBLE_DEVICES="")
    import torch.distributed as dist

    from distrain.parallel import process_group

    device = process_group.init_from_env()
    results = {}
    for name, (recipe, overrides) in DISTRIBUTED.items():
        parallel, layout = built(recipe, Path(root), *overrides, collective=True, device=device)
        weight = parallel.module.layers["0"].attention.wq.weight
        losses, norms, optimizer = train(parallel, layout.data_shard(rank))
        total = torch.stack(losses)
        dist.all_reduce(total)  # the loop's global mean: every loss holder's local means, summed
        gathered = type(getattr(weight, "_local_tensor", weight)).__name__
        results[name] = {"loss": (total / (layout.micro_batches * layout.loss_holders)).tolist(), "grad_norm": norms,
                         "sharded as": gathered}  # fmt: skip
        if name == "zero3_tensorwise":
            results["resumed"] = resumed(parallel, optimizer, (recipe, overrides), Path(root, name), device)
    if rank == 0:
        torch.save(results, Path(root, "results.pt"))
    process_group.destroy()


def resumed(parallel, optimizer, case: tuple, path: Path, device: torch.device) -> list[str]:  # noqa: ANN001
    """The weights a checkpoint saved in the background (DCP's stager, as a run saves) and loaded into a fresh
    model hold: the names of those that differ from the trained model's."""
    from types import SimpleNamespace

    from distrain.parallel.parallelize import as_tensor
    from distrain.storage import checkpoint, saver
    from distrain.train.state import checkpoint_state

    def state(p, o) -> dict:  # noqa: ANN001
        return checkpoint_state(SimpleNamespace(module=p.module, parallel=p, frozen=set()), o)[0]

    writer = saver.Saver(path, keep=1, background=True)
    writer.save(STEPS, state(parallel, optimizer), {"step": STEPS, "world_size": WORLD}, {})
    writer.close()
    fresh, _ = built(case[0], path, *case[1], collective=True, device=device)
    target = state(fresh, torch.optim.AdamW(fresh.module.parameters()))
    checkpoint.load(checkpoint.checkpoints(path)[0], target)
    want, got = parallel.module.state_dict(), fresh.module.state_dict()
    return [k for k in want if not torch.equal(as_tensor(want[k]), as_tensor(got[k]))]


@pytest.mark.timeout(300)
def test_fsdp2_and_tensor_parallel_float8_match_one_process(tmp_path: Path, one_process: dict):
    spawn_ranks(rank_main, (free_port(), str(tmp_path)), WORLD)
    results = torch.load(tmp_path / "results.pt")
    assert results["zero3_tensorwise"]["sharded as"] == "WeightWithDynamicFloat8CastTensor"  # gathered in float8
    assert results["resumed"] == [], "weights saved in the background and loaded back differ"
    for name, (recipe, _) in DISTRIBUTED.items():
        for key in ("loss", "grad_norm"):
            got, want = torch.tensor(results[name][key]), torch.tensor(one_process[recipe][key])
            torch.testing.assert_close(got, want, rtol=0, atol=DIST_TOL, msg=f"{name} {key}")
