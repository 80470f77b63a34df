"""What the shipped families (llama.py, gpt2.py) share: a base class keeping their part of the contract
alike (initial weights drawn per parameter name, the tied head, FLOPs from the family's record), and
the Megatron tensor-parallel plan over their common names (tok_embeddings, optional
pos_embeddings, layers.{i}.attention_norm / attention.{wq,wk,wv,wo} / ffn_norm / feed_forward.w*, norm,
output). A user's model may use these or write its own (contract.py)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from distrain.config import ModelConfig
from distrain.model.contract import fill_parameters, tie
from distrain.model.families import Family
from distrain.model.families.family import OUTPUT_MODULES


class SequenceSplit(Protocol):
    """What a model reads of context parallelism's split (distrain/parallel/context_parallel.py)."""

    def positions(self, device: torch.device) -> torch.Tensor: ...


def parameter_seed(seed: int, name: str) -> int:
    """A 64-bit seed for one parameter: stable across processes and runs (Python's `hash` is salted)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def initial_value(cfg: ModelConfig, seed: int, name: str, shape: torch.Size) -> torch.Tensor:
    """Parameter `name`'s full initial value, from its own generator seeded by (seed, name), on the CPU.
    Normal(0, init_std); norms' gains 1 and biases 0; the projections into the residual stream are
    scaled by 1/sqrt(2 n_layers) so the stream's variance does not grow with depth (GPT-2)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device="cpu")
    if name.endswith(".bias"):
        return torch.zeros(shape, device="cpu")
    std = cfg.init_std
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        std /= math.sqrt(2 * cfg.n_layers)
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.empty(shape, device="cpu").normal_(0.0, std, generator=generator)


class CausalAttention(nn.Module):
    """softmax(QKᵀ/√d)V under a causal mask, as its own module so that context parallelism can swap it for
    one that sees the whole sequence (distrain/parallel/context_parallel.py). q (b, heads, t, d); k and v
    (b, kv_heads, t, d), kv_heads dividing heads (grouped-query attention)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class FamilyModel(nn.Module):
    """A shipped family's model: a subclass names its `family` record, builds its modules between
    `super().__init__` and `self.ready()`, and adds its forward and tensor-parallel plans. Its initial
    weights are a function of `seed` and each parameter's name alone.

    Built on the meta device (`with torch.device("meta")`) it allocates nothing: a parallel layout
    shards it first, then `to_empty` and `init_weights` give each rank its shard of these weights."""

    family: Family
    input_modules: tuple[str, ...]
    output_modules = OUTPUT_MODULES
    # Set by context parallelism: which of each sequence's positions this rank's tokens are.
    sequence_split: SequenceSplit | None = None
    # Set by the chunked loss (trainer.loss_chunk, distrain/parallel/chunked_loss.py): forward returns the final
    # norm's output and the loss applies the head a slice of the sequence at a time.
    head_skipped = False

    def __init__(self, cfg: ModelConfig, max_seq_len: int, seed: int = 0):
        super().__init__()
        self.cfg, self.max_seq_len, self.seed = cfg, max_seq_len, seed

    def ready(self) -> None:
        """Tie the head and, off the meta device, draw the initial weights (on it, the layout does)."""
        tie(self)
        if not self.tok_embeddings.weight.is_meta:
            self.init_weights()

    @property
    def tied_parameters(self) -> tuple[tuple[str, str], ...]:
        """The head's weight is the token embedding's when model.tie_embeddings."""
        return (("output.weight", "tok_embeddings.weight"),) if self.cfg.tie_embeddings else ()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every parameter its initial value (initial_value), drawn whole on the CPU one at a time, so
        the weights are the same on every device and under every layout while at most one full
        parameter exists at once. A sharded parameter (a DTensor: FSDP2, TP) keeps only its piece."""
        fill_parameters(self, lambda name, shape: initial_value(self.cfg, self.seed, name, shape))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The logits of the final hidden states `h`; `h` itself on a stage without the head or when the loss
        applies it (`head_skipped`)."""
        return self.output(h) if self.output is not None and not self.head_skipped else h

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """The positions in their sequence of the t tokens of each sequence this rank holds: 0..t-1, or
        under context parallelism (`sequence_split`) its rank's share of the whole sequence."""
        if self.sequence_split is None:
            return torch.arange(t, device=device)
        return self.sequence_split.positions(device)

    def flops_per_token(self, seq_len: int) -> float:
        return self.family.flops_per_token(self.cfg, seq_len)


# A block's feed-forward plan: (its name, the module) → the styles of it and its parts.
FeedForwardPlan = Callable[[str, nn.Module], dict[str, ParallelStyle]]


def mlp_plan(name: str, mlp: nn.Module) -> dict[str, ParallelStyle]:
    """A dense MLP's: its input gathered from the sequence-sharded stream, `w2` split by input row and
    reduce-scattered back into it, every other projection (w1, w3) split by output column."""
    plan: dict[str, ParallelStyle] = {
        name: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    }
    for w, _ in mlp.named_children():
        plan[f"{name}.{w}"] = RowwiseParallel(output_layouts=Shard(1)) if w == "w2" else ColwiseParallel()
    return plan


class Replicated(ParallelStyle):
    """A module's parameters whole on every tensor-parallel rank, as DTensors `Replicate()` (torchtitan's
    NoParallel): its ranks compute the same values, so each one's gradient is the whole one, and a model's
    parameters stay DTensors on one mesh, as the gradient norm and the optimizer's kernels need. The module's
    inputs and outputs are left alone: its forward takes the parameters' local tensors (moe.local)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, partition_fn=_replicate)


def _replicate(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Each parameter of `module` (not its children's) a Replicate DTensor of its own value: no communication."""
    for key, p in list(module.named_parameters(recurse=False)):
        whole = DTensor.from_local(p, mesh, [Replicate()], run_check=False)
        module.register_parameter(key, nn.Parameter(whole, requires_grad=p.requires_grad))


def megatron_plan(
    model: nn.Module, loss_parallel: bool, attention_args: int, feed_forward: FeedForwardPlan = mlp_plan
) -> dict[str, ParallelStyle]:
    """Megatron-style tensor parallelism with sequence parallelism, for `parallelize_module`.

    Q/K/V and the MLP's input projections split by output column, `wo` and `w2` by input row, so
    each block needs one all-gather in and one reduce-scatter out per sublayer. Between them the
    residual stream and the norms stay sharded over the sequence. The embeddings (tokens and learned
    positions) split over their rows and reduce-scatter into the sequence-sharded stream; a tied head
    and embedding are both split over the vocabulary (Shard(0)). The head's logits stay sharded over
    the vocabulary when `loss_parallel`. `attention_args`: arguments the attention takes after x
    (llama's rotary tables); `feed_forward`: each block's feed-forward plan (the moe family's experts
    have their own). Parts a pipeline stage dropped are left out. Per-head norms of Q and K (model.qk_norm)
    see the heads of their rank: SequenceParallel over the heads' dim (2 of (b, t, heads, d)) keeps their
    gains whole and sums the gains' gradients over the tensor-parallel ranks, as it does the other norms'."""
    plan: dict[str, ParallelStyle] = {}
    for name in ("tok_embeddings", "pos_embeddings"):
        if getattr(model, name, None) is not None:
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.output is not None:
        plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    rest = (None,) * attention_args
    for name, block in model.layers.items():
        prefix = f"layers.{name}"
        plan |= {
            f"{prefix}.attention_norm": SequenceParallel(),
            f"{prefix}.attention": PrepareModuleInput(
                input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest)
            ),
            f"{prefix}.attention.wq": ColwiseParallel(),
            f"{prefix}.attention.wk": ColwiseParallel(),
            f"{prefix}.attention.wv": ColwiseParallel(),
            f"{prefix}.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            f"{prefix}.ffn_norm": SequenceParallel(),
        }
        if getattr(block.attention, "q_norm", None) is not None:  # model.qk_norm: gains copied, the heads split
            per_head = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan |= {f"{prefix}.attention.q_norm": per_head, f"{prefix}.attention.k_norm": per_head}
        plan |= feed_forward(f"{prefix}.feed_forward", block.feed_forward)
    return plan
