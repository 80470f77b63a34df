"""Context parallelism (distrain/parallel/context_parallel.py, ring_attention.py): 10 steps of every layout
below, on 4 gloo ranks in one spawn, give the loss and gradient norm of the same 10 steps in one process to
1e-4 (Llama with grouped-query attention, with Qwen3's attention too, and GPT-2 with learned positions; ring and
all-to-all; alone, beside data parallelism (DDP, FSDP2 over dp_shard × cp), tensor and pipeline parallelism).
The same spawn counts what a rank sends per layer and what it keeps for the backward, against theory and the
plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import free_port, logged, make_config, rank_env, spawn_ranks, train_half_then_resume

WORLD = 4
STEPS = 10
TOL = 1e-4
LLAMA = ("model.n_heads=4", "model.n_kv_heads=2")  # grouped-query: K/V heads travel, each serving two
# Qwen3's attention: heads 24 wide (not dim / n_heads = 32), each head's Q and K RMS-normed (their gains copied on
# the tensor-parallel ranks, which hold different heads: the gains' gradients summed over them)
QWEN3 = (*LLAMA, "model.qk_norm=true", "model.head_dim=24")
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
    "cp2_tp2_ring_qwen3": (QWEN3, ("strategy=tp", "strategy.cp=2")),
    "cp2_tp2_alltoall_gpt2": (GPT2, ("strategy=tp", "strategy.cp=2", "strategy.cp_mode=alltoall")),
    "cp2_pp2_ring_gpt2": (GPT2, ("strategy=pp", "strategy.cp=2")),
}
# Activation memory at a longer sequence: one micro-batch of 512 tokens, held whole, by 2 and by 4.
LONG = ("model.n_heads=4", "trainer.seq_len=512", "trainer.micro_batch_size=1", "trainer.global_batch_size=4")
MEMORY = {cp: (*LONG, f"strategy.cp={cp}") for cp in (1, 2, 4)}
# One layer's attention, for the bytes a rank sends: micro-batch 2, 4 heads of 8, 64 tokens in all.
B, H, D, T = 2, 4, 8, 64


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


def built(case: tuple[dict, dict], device: torch.device) -> tuple:
    """A case's config, layout and ParallelModel, built as a Learner builds it (on the meta device, then laid out;
    trainer.loss_chunk taken as the Learner takes it: test_chunked_loss.py's cases set it)."""
    from distrain.config import from_plain
    from distrain.model.registry import build_model
    from distrain.parallel.parallelize import ParallelModel
    from distrain.strategy.layout import Layout
    from distrain.train.learner import cross_entropy

    cfg, layout = from_plain(case[0]), Layout.from_dict(case[1])
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.trainer.seq_len, seed=cfg.trainer.seed)
    chunk = cfg.trainer.loss_chunk
    return cfg, layout, ParallelModel(model, cfg.strategy, layout, device, False, cross_entropy, loss_chunk=chunk)


def rank_main(rank: int, port: int, cases: dict, memory: dict, out: str) -> None:
    rank_env(rank, WORLD, port, CUDA_VISIBLE_DEVICES="")
    import torch.distributed as dist

    from distrain.parallel import process_group

    device = process_group.init_from_env()
    results = {}
    for name, case in cases.items():
        cfg, layout, parallel = built(case, device)
        losses, norms = train_steps(parallel, layout, batches(cfg), layout.data_shard(rank))
        total = torch.stack(losses)
        dist.all_reduce(total)  # the loop's global mean: every loss holder's local means, summed
        results[name] = {"loss": (total / (layout.micro_batches * layout.loss_holders)).tolist(), "grad_norm": norms}
    results |= measure(rank, device, memory)
    if rank == 0:
        torch.save(results, Path(out, "results.pt"))
    process_group.destroy()


def measure(rank: int, device: torch.device, memory: dict) -> dict:
    """What a rank keeps for the backward inside the blocks on a real step (MEMORY's layouts), and what it
    sends for one layer's attention, forward and backward, in each mode at cp 2 and 4."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from distrain.parallel.context_parallel import ContextParallelAttention, SequenceSplit
    from distrain.parallel.traffic import Traffic, saved_activations
    from distrain.strategy.context_parallel import CP_MODES
    from distrain.train.learner import cross_entropy

    results = {}
    for cp, case in memory.items():
        cfg, _, parallel = built(case, device)
        rows = batches(cfg)[0][:1]
        x, y = parallel.local_tokens(rows[:, :-1], rows[:, 1:])
        blocks = getattr(parallel.module, "module", parallel.module).layers.values()  # inside DDP
        with saved_activations(parallel.module, inside=list(blocks)) as held:
            cross_entropy(parallel.module(x), y).backward()
        results[f"memory/cp{cp}"] = held["inside"]
    for cp in (2, 4):
        mesh = init_device_mesh("cpu", (WORLD // cp, cp), mesh_dim_names=("rest", "cp"))
        split = SequenceSplit(cp, mesh.get_local_rank("cp"))
        for mode in CP_MODES:
            attention = ContextParallelAttention(mesh.get_group("cp"), mode, split)
            q, k, v = (torch.randn(B, H, T // cp, D, requires_grad=True) for _ in range(3))
            with Traffic() as traffic:
                attention(q, k, v).sum().backward()
            results[f"sent/{mode}/cp{cp}"] = traffic.total("sent")
            results[f"bf16/{mode}/cp{cp}"] = bf16_errors(attention, split)
        with sdpa_kernel(SDPBackend.MATH):  # sdpa limited to its math path: the ring's blocks by plain matmuls
            ring = ContextParallelAttention(mesh.get_group("cp"), "ring", split)
            results[f"bf16/ring-math/cp{cp}"] = bf16_errors(ring, split)
    return results


def bf16_errors(attention, split) -> tuple[float, float]:
    """The cp attention under bf16 autocast, on bf16 q, k, v, against fp32 attention over the whole sequence of
    the same values: the largest error of its output and of its gradients, each relative to the largest value,
    the most of the ranks'."""
    import torch.distributed as dist
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, T, D, generator=g).bfloat16().float().requires_grad_() for _ in range(3))
    grad = torch.randn(B, H, T, D, generator=g).bfloat16().float()
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    whole.backward(grad)
    mine = split.index(T, torch.device("cpu"))
    local = [t.detach()[:, :, mine].bfloat16().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(*local)
    out.backward(grad[:, :, mine].bfloat16())

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.float() - want).abs().max() / want.abs().max()).item()

    grads = max(error(t.grad, w.grad[:, :, mine]) for t, w in zip(local, (q, k, v), strict=True))
    most = torch.tensor([error(out, whole.detach()[:, :, mine]), grads])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return most[0].item(), most[1].item()


def reference(cfg) -> dict[str, list[float]]:
    """The same steps in this process, the whole model, no process group."""
    from distrain.model.registry import build_model
    from distrain.parallel.parallelize import ParallelModel
    from distrain.strategy.resolve import single
    from distrain.train.learner import cross_entropy

    layout = single(cfg.trainer.global_batch_size // cfg.trainer.micro_batch_size)
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
    memory = {}
    for cp, overrides in MEMORY.items():
        cfg = make_config(tmp, f"cluster.num_workers={WORLD}", *overrides)
        memory[cp] = (to_plain(cfg), validate(cfg).as_dict())
    spawn_ranks(rank_main, (free_port(), cases, memory, str(tmp)), WORLD)
    got = torch.load(tmp / "results.pt")
    return {name: (got[name], refs[CASES[name][0]]) for name in CASES} | {
        key: value for key, value in got.items() if "/" in key
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_context_parallel_matches_one_process(case: str, runs):
    got, want = runs[case]
    for key in ("loss", "grad_norm"):
        for step, (a, b) in enumerate(zip(got[key], want[key], strict=True), 1):
            assert a == pytest.approx(b, rel=TOL, abs=TOL), f"{case}: {key} at step {step}: {a} vs {b}"


def test_a_rank_sends_what_theory_says_per_layer(runs):
    """Counted as docs/tensor-parallel.md counts (distrain/parallel/traffic.py): exactly the theory's bytes."""
    from distrain.strategy.context_parallel import CP_MODES, attention_traffic

    for cp in (2, 4):
        for mode in CP_MODES:
            want = attention_traffic(mode, cp, B * T // cp, H, H, D, 4)
            assert runs[f"sent/{mode}/cp{cp}"] == want, f"{mode} cp {cp}"


def test_attention_in_bf16_errs_no_more_than_its_rounding(runs):
    """Under bf16 autocast (q, k, v, the output and its gradient in bf16), both modes' attention stays within
    bf16's rounding of the fp32 result, the gradients within 2⁻⁷ of their largest value, the output within 2⁻⁸
    (one rounding) where the kernel's output is the result: all-to-all's, and the ring's math fallback, which
    does its blocks' math in fp32 whatever the block runs in (in bf16 it errs 5× more). The ring's fused kernels
    round each block's output to bf16 before the fp32 merge, and the merged output is rounded again: 2⁻⁷."""
    bounds = {"alltoall": 2**-8, "ring-math": 2**-8, "ring": 2**-7}
    for mode, bound in bounds.items():
        for cp in (2, 4):
            out, grads = runs[f"bf16/{mode}/cp{cp}"]
            print(f"{mode} cp {cp}: output {out:.5f}, gradients {grads:.5f}")
            assert out <= bound and grads <= 2**-7, (mode, cp, out, grads)


def test_activation_memory_falls_as_one_over_cp(runs, tmp_path: Path):
    """What a rank keeps for the backward inside the blocks, on a real step, falls as 1/cp, as the plan's
    estimate does, and stays within the estimate's reach."""
    from distrain.driver.plan import layer_activations
    from distrain.strategy.resolve import resolve

    measured = {cp: runs[f"memory/cp{cp}"] for cp in MEMORY}
    for cp in MEMORY:
        cfg = make_config(tmp_path, f"cluster.num_workers={WORLD}", *MEMORY[cp])
        estimate = cfg.model.n_layers * layer_activations(cfg, resolve(cfg), "fp32", scores=False)[0]
        print(f"cp {cp}: measured {measured[cp]} B, plan {estimate} B")
        assert measured[1] / measured[cp] == pytest.approx(cp, rel=0.05), measured
        assert 0.5 < measured[cp] / estimate < 1.5, (cp, measured[cp], estimate)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (("strategy.cp=3", "cluster.num_workers=3"), "splits each sequence into 2·cp = 6 chunks"),
        (("strategy.cp_mode=alltoall",), "strategy.cp_mode=alltoall chooses how context parallelism exchanges"),
        (
            ("strategy.cp=2", "cluster.num_workers=4", "strategy.cp_mode=ulysses"),
            "is not a context-parallel mode; choose ring or alltoall",
        ),
        (
            ("strategy.cp=4", "cluster.num_workers=4", "strategy.cp_mode=alltoall"),
            "heads / (cp × tp) = 2 / 4 of model.n_heads=2",
        ),
        (  # grouped-query: the query heads divide, the K/V heads do not
            ("strategy.cp=4", "cluster.num_workers=4", "strategy.cp_mode=alltoall", *LLAMA),
            "heads / (cp × tp) = 2 / 4 of model.n_kv_heads=2",
        ),
        (("strategy.cp=2", "strategy=tp2d", "cluster.num_workers=8"), "does not combine with strategy.tp_mode=2d"),
        (("strategy.cp=2", "cluster.num_workers=4", "strategy.compile=true"), "does not support strategy.compile=true"),
        (("strategy.cp=2", "strategy=ps", "cluster.num_workers=2"), "does not combine with ps.mode=sync"),
        (
            (
                "strategy.cp=2",
                "strategy=tp",
                "strategy.tp=4",
                "model.n_heads=4",
                "trainer.seq_len=20",
                "cluster.num_workers=8",
            ),
            "leaves trainer.seq_len / cp = 10 tokens per rank, which strategy.tp=4",
        ),
    ],
)
def test_a_layout_cp_cannot_split_is_refused_in_one_line(overrides: tuple, needle: str, tmp_path: Path):
    from distrain.config import ConfigError
    from distrain.driver.validation import validate

    cfg = make_config(tmp_path, *overrides)
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    assert needle in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_the_plan_shows_each_ranks_tokens_and_its_memory(tmp_path: Path):
    from conftest import fake_table

    from distrain.driver.plan import describe
    from distrain.driver.validation import validate

    def plan(cp: int, mode: str = "ring") -> list[str]:
        given = (f"strategy.cp={cp}", *([f"strategy.cp_mode={mode}"] if cp > 1 else []), "trainer.seq_len=64")
        cfg = make_config(tmp_path, "cluster.num_workers=4", *given)
        return describe(cfg, validate(cfg), fake_table(4, 4, gpus=False)).splitlines()

    lines = plan(2)
    assert "context parallel (ring: K/V passed round the ring); each rank holds 32 of 64 tokens:" in lines
    assert "  cp rank 0: tokens 0-15, 48-63" in lines and "  cp rank 1: tokens 16-31, 32-47" in lines
    assert "  cp: [0,1] [2,3]" in lines and "  dp_replicate: [0,2] [1,3]" in lines
    # 2 sequences × 32 tokens × 2 heads × 16 of fp32: K and V 8 KiB each, a hop each way; dK and dV 2 hops home
    assert "  each rank sends 0.06 MiB per layer and micro-batch (forward and backward)" in lines

    def activations(lines: list[str]) -> str:
        return next(line for line in lines if line.startswith("  every rank:")).split("activations ")[1].split(" (")[0]

    # 2 layers of 34·s·b·h + 5·a·s²·b fp32 bytes (s 64, b 2, h 32, a 2): 864 KiB; all-to-all halves it all (its
    # fused kernel's scores: heads/cp of them); the ring holds no scores: 272 KiB of blocks, and at most 64 KiB of
    # tiles (its math fallback's 4 fp32 tiles of 32 queries by the rank's 32 keys, 2 heads, 2 sequences) while a
    # block runs.
    assert activations(plan(1)) == "864.0 KiB"
    assert (activations(plan(2, "alltoall")), activations(lines)) == ("432.0 KiB", "336.0 KiB")
    assert "attention scores counted (under ring cp none: a tile of query rows at a time)" in "\n".join(lines)


@pytest.mark.timeout(300)
def test_checkpoints_move_between_cp_and_no_cp(ray_cluster, tmp_path: Path):
    """Checkpoints hold no layout: 3 steps of ZeRO-1 × cp 2 (its optimizer state sharded over dp 2) resumed on
    one worker without cp, and 3 steps on one worker resumed under cp 2, log the same 6 steps (each half also
    compared across the two: cp's parity with one process, through the whole driver and loop)."""
    zero1_cp2, cp2, one = (4, ["strategy=zero1", "strategy.cp=2"]), (2, ["strategy.cp=2"]), (1, [])
    there = train_half_then_resume(tmp_path, "cp_then_none", zero1_cp2, one, 6)
    back = train_half_then_resume(tmp_path, "none_then_cp", one, cp2, 6)
    for key in ("loss", "grad_norm"):
        a, b = logged(there, key), logged(back, key)
        assert sorted(a) == sorted(b) == list(range(1, 7))
        for step in a:
            assert a[step] == pytest.approx(b[step], rel=TOL, abs=TOL), f"{key} at step {step}"


def test_a_model_without_causal_attention_is_refused_under_cp(tmp_path: Path, monkeypatch):
    """examples/user_model computes its attention itself: cp cannot split it, and says so before any worker."""
    from conftest import REPO

    from distrain.config import ConfigError
    from distrain.driver.validation import validate

    monkeypatch.syspath_prepend(str(REPO / "examples"))
    user = ("model._target_=user_model.decoder.Decoder", "model.name=decoder", "cluster.num_workers=2")
    validate(make_config(tmp_path, *user))
    with pytest.raises(ConfigError, match="computes its attention outside distrain.model.common.CausalAttention"):
        validate(make_config(tmp_path, *user, "strategy.cp=2"))
