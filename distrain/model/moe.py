"""The moe family: the Llama decoder (llama.py) whose chosen blocks (model.moe.is_sparse) replace their MLP by
`num_experts` SwiGLU experts, a router choosing `top_k` of them per token, and optional shared experts.

The layer runs in three plain steps: route (scores, the top-k choice, the weights), dispatch (each token's
copies sorted by expert, so every expert's tokens are contiguous), and the experts' matmuls over their
contiguous rows (one per expert, or one grouped matmul where torch has it on the device). Expert
parallelism (distrain/parallel/expert_parallel.py) changes only where the sorted rows meet their experts
(`MoE.exchange`): it sends them to their experts' ranks and back. Tensor parallelism (`moe_tp_plan`) gives every
rank of a tensor-parallel group the same tokens: the router and the experts whole on each, the shared experts split
as a dense MLP.

Load balancing is one of: the Switch/Mixtral auxiliary loss, whose gradient joins the backward pass at the
layer's output (`AuxLoss`) so that every pipeline stage trains its own routers without the loss crossing
stages; or DeepSeek-V3's loss-free per-expert bias, which moves the choice (never the weights) towards the
mean load after each step (`MoE.balance`). Each layer keeps the step's tokens per expert (`load`) for both,
and for the metrics.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    RowwiseParallel,
)

from distrain.config import ModelConfig, MoEConfig
from distrain.model.common import Replicated, megatron_plan, mlp_plan
from distrain.model.families.moe import FAMILY
from distrain.model.llama import FeedForward, Transformer


class AuxLoss(torch.autograd.Function):
    """Returns `out` unchanged; in the backward pass gives `loss` the gradient `scale` (Megatron's
    MoEAuxLossAutoScaler): the loss trains the router as if it were added to the model's loss, which the step
    scales by `scale` too (1 / micro-batches; a pipeline scales every gradient itself, so 1 there)."""

    scale = 1.0

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(loss)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, AuxLoss.scale)


@contextlib.contextmanager
def aux_loss_scale(scale: float) -> Iterator[None]:
    """The factor the step multiplies the model's loss by before its backward pass (AuxLoss)."""
    before, AuxLoss.scale = AuxLoss.scale, scale
    try:
        yield
    finally:
        AuxLoss.scale = before


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Activation checkpointing's second forward of a block, in the backward pass (parallelize.py): the same routing
    again, which the step's figures must not count twice (dropped copies, forwards; the loads)."""
    before, MoE.recomputing = MoE.recomputing, True
    try:
        yield
    finally:
        MoE.recomputing = before


def route(logits: torch.Tensor, m: MoEConfig, bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(scores (tokens, experts), the chosen experts (tokens, top_k), their weights (tokens, top_k)), in fp32.
    The bias moves the choice only: the weights are the chosen experts' unbiased scores."""
    logits = logits.float()
    scores = logits.softmax(-1) if m.score == "softmax" else logits.sigmoid()
    chosen = torch.topk(scores if bias is None else scores + bias, m.top_k, dim=-1).indices
    weights = scores.gather(-1, chosen)
    if m.normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return scores, chosen, weights


def local(w: torch.Tensor) -> torch.Tensor:
    """A parameter's local tensor: a DTensor's (expert parallelism's share of the experts, tensor parallelism's
    whole copy), which the routing's sorts and counts can use; a plain tensor as it is."""
    return w.to_local() if hasattr(w, "to_local") else w


class Experts(nn.Module):
    """`num` SwiGLU experts as three stacked weights, (num, hidden, dim) for w1 and w3 and (num, dim, hidden)
    for w2: expert e's are nn.Linear weights as a dense MLP holds them (Hugging Face's per-expert tensors)."""

    def __init__(self, num: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num, dim, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: the tokens sorted by expert, `counts[e]` rows for this module's expert e in turn."""
        h = F.silu(self.project("w1", x, counts)) * self.project("w3", x, counts)
        return self.project("w2", h, counts)

    def project(self, name: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The rows of `x` through weight `name` of their experts (LoRA's experts add their adapters here)."""
        # the local experts, in the compute dtype (FSDP2 leaves expert parallelism's out of its cast)
        return grouped_linear(x, local(getattr(self, name)).to(x.dtype), counts)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`counts[e]` rows of `x` in turn times `w[e]`ᵀ (w: (experts, out, in)): one grouped matmul where torch has it
    on the device, else one matmul per expert."""
    if grouped_mm_usable(x) and w.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0:  # its rows 16-byte aligned
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=counts.cumsum(0).to(torch.int32))
    return torch.cat([rows @ w[e].T for e, rows in enumerate(x.split(counts.tolist()))])


def grouped_mm_usable(x: torch.Tensor) -> bool:
    """torch's grouped matmul: CUDA, bf16, on a torch that has it (torch._grouped_mm, Hopper and later)."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


# What a layer counts over a step (MoE.figures), after its tokens per expert.
FIGURES = ("balance_loss", "z_loss", "dropped", "forwards")


class MoE(nn.Module):
    """A block's experts, router and shared experts. `figures` sums, over the forwards since `reset`, the token
    copies (top_k per token) sent to each expert, then FIGURES: the balance loss and z-loss unweighted, the
    copies dropped over an expert's capacity, and the forwards; a plain tensor, not a buffer, so that DDP does
    not overwrite one rank's with another's."""

    recomputing = False  # a block's forward again in the backward pass (`recomputing`): its figures are counted

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.m = m
        hidden = m.expert_dim or cfg.ffn_dim
        self.router = nn.Linear(cfg.dim, m.num_experts, bias=False)
        self.experts = Experts(m.num_experts, cfg.dim, hidden)
        self.shared = FeedForward(cfg.dim, hidden * m.shared_experts) if m.shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(m.num_experts), persistent=m.balance == "bias")
        self.figures: torch.Tensor | None = None
        # Set by context parallelism: the ranks holding the rest of this rank's sequences, over whose tokens the
        # balance loss counts each expert's share (a product of means: over a share of the tokens it is another)
        self.sequence_group: dist.ProcessGroup | None = None
        # Set by expert parallelism: the rows sorted by expert (and their counts) through the experts on their
        # ranks and back; None: through this layer's own experts
        self.exchange: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, m = x.shape, self.m
        x = x.reshape(-1, shape[-1])
        logits = F.linear(x, local(self.router.weight))
        scores, chosen, weights = route(logits, m, self.expert_bias if m.balance == "bias" else None)
        counts = torch.bincount(chosen.flatten(), minlength=m.num_experts)
        keep, taken = self.within_capacity(counts)
        out = self.dispatch(x, chosen, weights.to(x.dtype), keep, taken)
        if self.shared is not None:
            out = out + self.shared(x)
        balance, z = self.router_losses(logits, scores, counts)
        if self.training and (m.aux_loss_weight > 0 and m.balance == "aux_loss" or m.z_loss_weight > 0):
            out = AuxLoss.apply(out, m.aux_loss_weight * balance * (m.balance == "aux_loss") + m.z_loss_weight * z)
        if MoE.recomputing:
            return out.reshape(shape)
        with torch.no_grad():
            dropped = counts.sum() - taken.sum()
            figures = torch.cat([counts.float(), torch.stack([balance, z, dropped.float(), torch.ones_like(z)])])
            self.figures = figures if self.figures is None else self.figures + figures
        return out.reshape(shape)

    def dispatch(
        self,
        x: torch.Tensor,
        chosen: torch.Tensor,
        weights: torch.Tensor,
        keep: torch.Tensor | None,
        counts: torch.Tensor,
    ) -> torch.Tensor:
        """Each token through its chosen experts, the outputs weighted and summed per token: the token copies
        sorted by expert (stable: in token order within an expert), those `keep` keeps (all: None), the experts
        over their `counts` rows each, and back to their tokens."""
        order = chosen.flatten().argsort(stable=True)
        if keep is not None:
            order = order[keep]
        token = order // self.m.top_k
        out = (self.exchange or self.experts)(x[token], counts) * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token, out.to(x.dtype))

    def within_capacity(self, counts: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Dropless (capacity_factor 0): (None, counts). Else which of the copies sorted by expert the experts
        take, each its first ones up to its capacity, and how many each takes."""
        m = self.m
        if m.capacity_factor <= 0:
            return None, counts
        copies = int(counts.sum())
        capacity = math.ceil(m.capacity_factor * copies / m.num_experts)
        starts = counts.cumsum(0) - counts
        keep = torch.arange(copies, device=counts.device) - starts.repeat_interleave(counts) < capacity
        return keep, counts.clamp(max=capacity)

    def router_losses(
        self, logits: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """(balance, z), unweighted. Balance (Switch): num_experts · Σ_e f_e · P_e, f_e the share of the token
        copies sent to e (of the whole sequences under context parallelism), P_e the mean over tokens of e's score
        normalised over the experts. z (ST-MoE): the mean over tokens of logsumexp(logits)²."""
        share = counts.float()
        if self.sequence_group is not None:
            dist.all_reduce(share, group=self.sequence_group)
        share = share / share.sum()
        probs = scores / scores.sum(-1, keepdim=True)
        balance = self.m.num_experts * (share * probs.mean(0)).sum()
        z = torch.logsumexp(logits.float(), -1).pow(2).mean()
        return balance, z

    @torch.no_grad()
    def balance(self, load: torch.Tensor) -> None:
        """After a step, with `load` the token copies per expert over every rank's share of the batch: the
        loss-free bias moves each expert's by bias_rate towards the mean load (up when under it, down when over)."""
        if self.m.balance == "bias":
            self.expert_bias += self.m.bias_rate * torch.sign(load.mean() - load)


class MoETransformer(Transformer):
    """The Llama decoder with experts in the blocks model.moe chooses; it keeps the contract of contract.py."""

    family = FAMILY

    def feed_forward(self, block: int) -> nn.Module:
        return MoE(self.cfg) if self.cfg.moe.is_sparse(block) else super().feed_forward(block)

    def tp_plan(self, loss_parallel: bool) -> dict[str, ParallelStyle]:
        """Llama's Megatron plan with sequence parallelism (common.megatron_plan), the blocks with experts laid out
        by `moe_tp_plan`."""
        return megatron_plan(self, loss_parallel, attention_args=2, feed_forward=feed_forward_plan)

    def grid_tp_plan(self) -> None:
        return None

    @torch.no_grad()
    def init_weights(self) -> None:
        """The parameters' initial values, the rotary tables, and every router's bias and figures zeroed."""
        super().init_weights()
        reset_routers(self)


def feed_forward_plan(name: str, module: nn.Module) -> dict[str, ParallelStyle]:
    """A block's feed-forward: its experts' plan, or a dense MLP's."""
    return moe_tp_plan(name, module) if isinstance(module, MoE) else mlp_plan(name, module)


def moe_tp_plan(name: str, layer: MoE) -> dict[str, ParallelStyle]:
    """1-D tensor parallelism of the MoE layer `name` in a sequence-parallel stream. Its input is gathered whole
    (every rank of the tensor-parallel group routes the same tokens), the router and the routed experts are whole
    on each rank (Replicated: each computes them, tp times the expert FLOPs, and each one's gradient and token counts
    are the whole group's, so nothing is summed over tp), the shared experts split as a dense MLP (w1 and w3 by
    column, w2 by row, all-reduced), and the output, the same on every rank, is cut back to this rank's share of
    the sequence (no communication). Expert parallelism then splits the experts as without tensor parallelism,
    each tensor-parallel rank exchanging with the ranks of its own tp index."""
    plan: dict[str, ParallelStyle] = {
        name: PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
        ),
        f"{name}.router": Replicated(),
        f"{name}.experts": Replicated(),
    }
    if layer.shared is not None:
        plan |= {f"{name}.shared.{w}": ColwiseParallel() for w in ("w1", "w3")}
        plan[f"{name}.shared.w2"] = RowwiseParallel()
    return plan


@torch.no_grad()
def reset_routers(model: nn.Module) -> None:
    """Every MoE layer's loss-free bias zeroed and its figures cleared: part of a model's `init_weights`, since a
    model built on the meta device has its buffers unset until then. The contract a model of the user's own keeps
    to have experts (docs/models.md): `MoE(cfg)` as a block's feed-forward, and this in its init_weights."""
    for layer in moe_layers(model):
        layer.expert_bias.zero_()
        layer.figures = None


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of a model (or a stage of one), in block order."""
    return [m for m in model.modules() if isinstance(m, MoE)]
