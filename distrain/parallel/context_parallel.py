"""Context parallelism: each rank of the mesh's `cp` dim holds 1/cp of every sequence, so every activation
of a block (the attention scores too) is 1/cp of what it would be.

The split is load-balanced for the causal mask (distrain/strategy/context_parallel.py's `chunks`): `SequenceSplit`
cuts the inputs and targets of each batch (ParallelModel) and tells the model which positions its tokens are
(rotary tables, learned positions: `FamilyModel.positions`). Attention is the one place the tokens meet: the
pass swaps each `CausalAttention` of the model (distrain/model/common.py) for one that sees the whole sequence,
by one of two modes:

- ring: K/V passed round the cp group, overlapped with the local blocks (ring_attention.py);
- alltoall (DeepSpeed-Ulysses): an all-to-all turns (all heads, 1/cp of the sequence) into (1/cp of the heads,
  the whole sequence), attention runs as without cp, and a second all-to-all turns it back.

Every cp rank holds the same weights and different tokens, so gradients are averaged over cp as over data
parallelism (mesh.py's gradient mesh folds cp into the data-parallel group); each rank's loss is the mean over its
equal share of the tokens, and their mean is the whole sequence's.

torch.distributed.tensor.experimental.context_parallel is not used: in torch 2.13 it handles only the CUDA
attention kernels (flash, efficient, cuDNN), not the CPU one, so it cannot run on gloo; the ring calls the
same kernels itself, and the CPU's (attention_blocks.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from distrain.model.common import CausalAttention
from distrain.model.moe import MoE
from distrain.parallel.passes import PassContext
from distrain.parallel.ring_attention import RingAttention
from distrain.parallel.sequence_split import SequenceSplit


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Block i of x's first dim to cp rank i, rank i's block of x to block i here; its backward the same."""
    return wait_tensor(all_to_all_single_autograd(x, None, None, group))


def _heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor) -> torch.Tensor:
    """(b, heads, t, d) holding this rank's t tokens → (b, heads/cp, cp·t, d) holding the whole sequence, in
    order: head group j goes to cp rank j, and the ranks' chunks are put back in sequence order."""
    cp = dist.get_world_size(group)
    b, h, t, d = x.shape
    send = x.reshape(b, cp, h // cp, t, d).transpose(0, 1).contiguous()
    got = _all_to_all(send, group)  # (source rank, b, h/cp, t, d)
    whole = got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)  # the ranks' tokens, rank after rank
    return whole.index_select(2, order.argsort())


def _sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor) -> torch.Tensor:
    """The inverse of `_heads_to_sequence`."""
    cp = dist.get_world_size(group)
    b, hg, s, d = x.shape
    send = x.index_select(2, order).reshape(b, hg, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    got = _all_to_all(send, group)  # (source head group, b, h/cp, t, d)
    # laid out (b, t, heads, d) as the fused kernels lay theirs: the model's transpose back is then a view
    return got.permute(1, 3, 0, 2, 4).reshape(b, s // cp, cp * hg, d).transpose(1, 2)


class ContextParallelAttention(nn.Module):
    """Causal attention over the whole sequence, each rank holding its share of the tokens (q, k, v as
    CausalAttention takes them)."""

    def __init__(self, group: dist.ProcessGroup, mode: str, split: SequenceSplit):
        super().__init__()
        self.group, self.mode, self.split = group, mode, split

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.mode == "ring":
            return RingAttention.apply(q, k, v, self.group)
        cp = self.split.cp
        # the ranks' tokens, rank after rank, as positions in the sequence
        order = torch.cat([SequenceSplit(cp, r).index(q.shape[2] * cp, q.device) for r in range(cp)])
        q, k, v = (_heads_to_sequence(t, self.group, order) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return _sequence_to_heads(out, self.group, order)


def parallelize(model: nn.Module, on: PassContext) -> nn.Module:
    """Swap every CausalAttention for the cp one and give the model the split of its positions; the split is
    left in `on.sequence_split` for ParallelModel to cut the batches by."""
    layout = on.layout
    if layout.cp == 1:
        return model
    cp_mesh = on.mesh.get("cp")
    if on.sequence_split is None:
        on.sequence_split = SequenceSplit(layout.cp, cp_mesh.get_local_rank())
    swapped = 0
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, CausalAttention):
                setattr(module, name, ContextParallelAttention(cp_mesh.get_group(), layout.cp_mode, on.sequence_split))
                swapped += 1
    if not swapped:  # a user's model: the contract (distrain/model/contract.py) says what cp needs
        name = type(model).__name__
        raise ValueError(f"{name} has no CausalAttention module: strategy.cp needs its attention in one")
    model.sequence_split = on.sequence_split
    for layer in model.modules():
        if isinstance(layer, MoE):  # its balance loss counts the experts' shares over whole sequences
            layer.sequence_group = cp_mesh.get_group()
    return model
