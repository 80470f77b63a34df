"""The plan's memory estimate (`plan.rank_memory`) against memory measured on a real training step.

Four gloo processes, no Ray (a parallel-layer test). Each layout below is built as a worker builds
it (the tiny model, `ParallelModel`, `build_optimizer`) and takes two training steps; on every rank
we count, during the second:

- parameters, gradients and optimizer state: the bytes of the tensors the rank holds
  (`parallel.memory.state_bytes`; a DTensor counts its local shard);
- activations: the bytes autograd saves inside the transformer blocks, seen through
  `torch.autograd.graph.saved_tensors_hooks`: each saved tensor's storage counted once (q, k and v
  share their input), parameters and buffers left out, and a storage counted from when it is saved
  until autograd lets it go, so the number is the most the blocks hold at once: one micro-batch
  without a pipeline, the micro-batches in flight with one.

Then the plan for the same config and layout must say the same, within tolerances stated below. A LoRA run
(finetune.lora) on ZeRO-2 is measured beside full training on the same layout.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
from conftest import free_port, make_config, rank_env, spawn_ranks

WORLD = 4

# name → overrides; each a layout of 4 ranks over which the plan's formulas differ.
LAYOUTS = {
    "zero0": ("strategy=ddp",),  # dp_replicate=4
    "zero1": ("strategy=zero1",),  # dp_shard=4, optimizer state sharded
    "zero2": ("strategy=zero2",),  # and gradients
    "zero3": ("strategy=zero3",),  # and parameters
    "offload": ("strategy=offload",),  # ZeRO-3's shards in CPU memory
    "tp": ("strategy=tp",),  # tp=2 × dp_replicate=2: matrices split over tp, norms replicated
    "pp": ("strategy=pp",),  # pp=2 × dp_replicate=2, 1F1B: stage 0 holds 2 micro-batches, stage 1 one
    "zero2_lora": ("strategy=zero2", "finetune.lora.rank=4"),  # gradients and optimizer state of the adapters alone
    # a mixture of experts, ep=2: a rank holds half the experts, FSDP2 shards them over the other 2 ranks holding them
    "zero2_ep": ("strategy=zero2", "strategy.ep=2", "model=moe_nano", "model.moe.expert_dim=24"),
    # and LoRA on its experts: their adapters split as the experts, their base's gradients and optimizer state gone
    "zero2_ep_lora": (
        "strategy=zero2", "strategy.ep=2", "model=moe_nano", "model.moe.expert_dim=24", "finetune.lora.rank=4",
        "finetune.lora.targets=[attention,experts]",
    ),
}  # fmt: skip
MOE = ("zero2_ep", "zero2_ep_lora")  # the plan's activations are not those of a mixture of experts: not compared


class SavedActivations:
    """While entered, the bytes autograd saves inside the given blocks: `peak` is the most held at once."""

    def __init__(self, model, blocks):
        import torch

        self.model, self.inside, self.live, self.current, self.peak = model, 0, {}, 0, 0
        for block in blocks:
            block.register_forward_pre_hook(self._enter)
            block.register_forward_hook(self._leave)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _enter(self, *_):
        self.inside += 1

    def _leave(self, *_):
        self.inside -= 1

    @staticmethod
    def _storage(t):
        """The storage that holds a tensor's bytes: a wrapper subclass's (a DTensor's local shard,
        an all-gather's AsyncCollectiveTensor) is its inner tensor's."""
        while hasattr(t, "__tensor_flatten__"):
            inner, _ = t.__tensor_flatten__()
            t = getattr(t, inner[0])
        return t.untyped_storage()

    def _pack(self, t):
        if not self.inside:
            return t
        storage = self._storage(t)
        key, size = storage.data_ptr(), storage.nbytes()
        # What the model holds anyway: parameters (under FSDP the gathered ones) and the rotary tables.
        state = {self._storage(p).data_ptr() for p in (*self.model.parameters(), *self.model.buffers())}
        if size == 0 or key in state:
            return t
        if key not in self.live:
            self.live[key] = [size, 0]
            self.current += size
            self.peak = max(self.peak, self.current)
        self.live[key][1] += 1
        weakref.finalize(t, self._release, key)
        return t

    def _release(self, key):
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)


def measure(rank: int, port: int, cases: dict, out: str) -> None:
    """One rank: for each layout, one training step of the tiny model; its bytes to a file."""
    rank_env(rank, WORLD, port, CUDA_VISIBLE_DEVICES="")
    import torch

    from distrain.config import from_plain
    from distrain.model.llama import Block
    from distrain.model.lora import add_adapters
    from distrain.model.registry import build_model
    from distrain.parallel import process_group
    from distrain.parallel.memory import state_bytes
    from distrain.parallel.parallelize import ParallelModel
    from distrain.strategy.layout import Layout
    from distrain.train.learner import cross_entropy
    from distrain.train.optim import build_optimizer, local_optimizer

    device = process_group.init_from_env()
    results = {}
    for name, (plain, layout_dict) in cases.items():
        cfg, layout = from_plain(plain), Layout.from_dict(layout_dict)
        t = cfg.trainer
        model = add_adapters(build_model(cfg.model, t.seq_len, t.seed), cfg.finetune.lora, t.seed)
        parallel = ParallelModel(model, cfg.strategy, layout, device, False, cross_entropy)
        optimizer = build_optimizer(parallel.module, cfg.optim, parallel.zero1_group)
        # The rank's slice of a global batch: the same for tensor-parallel peers.
        generator = torch.Generator().manual_seed(layout.data_shard(rank)[0])
        x = torch.randint(
            0, cfg.model.vocab_size, (t.global_batch_size // layout.dp, t.seq_len + 1), generator=generator
        )
        # A first step, unmeasured: a pipeline stage's first step also runs a metadata-inference forward.
        parallel.forward_backward(x[:, :-1], x[:, 1:])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        blocks = [m for part in parallel.parts for m in part.modules() if isinstance(m, Block)]
        saved = SavedActivations(parallel.module, blocks)

        def step(parallel=parallel, optimizer=optimizer, x=x, saved=saved) -> None:  # bound now
            with saved:
                parallel.forward_backward(x[:, :-1], x[:, 1:])
            optimizer.step()

        results[name] = state_bytes(parallel.module, local_optimizer(optimizer), step)
        results[name]["activations"] = saved.peak
        results[name]["pp_rank"] = layout.coordinate(rank)["pp"]
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    process_group.destroy()


@pytest.mark.timeout(400)
def test_plan_memory_matches_a_measured_step(tmp_path: Path):
    """Tolerances. Parameters, gradients, optimizer state: within 0.1% of the plan on every rank. The
    tiny model's tensors all divide over 4 shards and 2 tensor-parallel ranks, so FSDP2's and
    DTensor's shards are exact and the measurements equal the plan to the byte; 0.1% leaves room for
    a shard's padding on other sizes, and is tight enough for the smallest mistake that matters here
    (the norms' gains divided over tp: 0.4% of a rank's parameters). ZeRO-1's optimizer state: within
    5% on each rank and 0.1% summed over the 4: ZeroRedundancyOptimizer hands out whole tensors,
    so ranks' shares differ by the tensors' sizes (measured: 0.3%).

    Activations: the plan's estimate (Korthikanti et al. 2022, doubled for fp32) must be an upper
    bound within 30%: measured/estimate in [0.7, 1.0] (measured: 0.82 without tensor parallelism,
    0.92 with it). The gap: the estimate counts 5·a·s²·b bytes (16-bit) of attention scores, softmax
    and dropout mask per layer, 23% of it here, which CPU's fused SDPA kernel never stores (it keeps
    its output and a log-sum-exp); what remains of the estimate is within 7% of the measured bytes (a
    Llama block saves more than the GPT block of the paper in some places, rotary embeddings and
    SwiGLU's three projections, and less in others, no dropout). Under tensor parallelism the ratio is
    higher because PyTorch's sequence parallelism saves the all-gathered input of the
    column-parallel projections whole, where the estimate divides everything by tp (Megatron keeps
    the shard and gathers again in the backward pass). Two ratios of the estimate are also measured
    directly: 1F1B's first stage holds two micro-batches in flight where the last holds one, and tp=2
    halves a rank's activations but for those gathered inputs."""
    from distrain.config import to_plain
    from distrain.driver.finetune import adapter_params
    from distrain.driver.plan import rank_memory
    from distrain.driver.validation import validate
    from distrain.model.size import num_params

    cases, plans = {}, {}
    for name, overrides in LAYOUTS.items():
        cfg = make_config(tmp_path, f"cluster.num_workers={WORLD}", *overrides)
        layout = validate(cfg)
        cases[name] = (to_plain(cfg), layout.as_dict())
        plans[name] = {pp_rank: rank_memory(cfg, layout, pp_rank, "fp32") for pp_rank in range(layout.pp)}

    spawn_ranks(measure, (free_port(), cases, str(tmp_path)), WORLD)
    measured = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]

    for name in LAYOUTS:
        for rank in range(WORLD):
            got = measured[rank][name]
            plan = plans[name][got["pp_rank"]]
            assert (plan.offload == "cpu") == (name == "offload")
            for kind in ("params", "grads", "optimizer"):
                want = getattr(plan, kind)
                tol = 0.05 if (name, kind) == ("zero1", "optimizer") else 0.001
                assert got[kind] == pytest.approx(want, rel=tol), f"{name} rank {rank} {kind}: {got[kind]} vs {want}"
            ratio = got["activations"] / plan.activations
            said = f"{name} rank {rank} activations: {got['activations']} vs {plan.activations}"
            assert name in MOE or 0.7 <= ratio <= 1.0, said
    # LoRA against full training on the same layout (ZeRO-2): gradients and optimizer state shrink to the adapters'
    # share of the parameters (rank 4 on this tiny model: 4,352 of 37,024; measured 4,352 B of gradients per rank
    # against 37,024 B, 8,704 B of AdamW state against 74,048 B), and the parameters grow by it.
    cfg = make_config(tmp_path, *LAYOUTS["zero2_lora"])
    share = adapter_params(cfg) / num_params(cfg.model, cfg.trainer.seq_len)
    for rank in range(WORLD):
        lora, full = measured[rank]["zero2_lora"], measured[rank]["zero2"]
        for kind in ("grads", "optimizer"):
            assert lora[kind] == pytest.approx(share * full[kind], rel=0.001), (rank, kind)
        assert lora["params"] == pytest.approx((1 + share) * full["params"], rel=0.001)
    zero1_total = sum(m["zero1"]["optimizer"] for m in measured)
    assert zero1_total == pytest.approx(WORLD * plans["zero1"][0].optimizer, rel=0.001)

    def activations(name: str, rank: int) -> int:
        return measured[rank][name]["activations"]

    # pp: ranks 0, 1 hold stage 0 (embedding, layer 0), ranks 2, 3 stage 1 (layer 1, head): one block each.
    assert activations("pp", 0) == pytest.approx(2 * activations("pp", 2), rel=0.01)
    assert plans["pp"][0].activations == 2 * plans["pp"][1].activations
    # tp=2: half the unsharded model's (zero0, the same micro-batch of 2 sequences), plus the gathered inputs.
    assert activations("tp", 0) == pytest.approx(activations("zero0", 0) / 2, rel=0.15)
