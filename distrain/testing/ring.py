"""Ring attention's arithmetic without its exchanges: what every cp rank computes (ring_attention.attend and
attend_backward, each block by the kernel sdpa picks), rank after rank on one device. tests/test_attention_blocks.py
holds it to sdpa on the whole sequence; jobs/bench/bench_ring.py times it and measures one rank's memory."""

from __future__ import annotations

import torch

from distrain.parallel.attention_blocks import kernel_for
from distrain.parallel.ring_attention import add_to, attend, attend_backward
from distrain.parallel.sequence_split import SequenceSplit

Chunks = list[list[torch.Tensor]]  # each rank's q, k, v, dout: its two chunks of the sequence


def split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, cp: int) -> tuple[list, Chunks]:
    """Each rank's token positions and its share of q, k, v and the output's gradient (dim 2: the sequence)."""
    index = [SequenceSplit(cp, r).index(q.shape[2], q.device) for r in range(cp)]
    return index, [[t[:, :, i].contiguous() for t in (q, k, v, dout)] for i in index]


def rank_forward(mine: Chunks, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s merged output and lse (fp32), its queries against every rank's K/V in the ring's order."""
    cp, q = len(mine), mine[rank][0]
    kernel, merged = kernel_for(q), None
    for step in range(cp):
        source = (rank - step) % cp
        merged = attend(kernel, q, mine[source][1:3], rank, source, merged)
    return merged


def rank_backward(mine: Chunks, rank: int, merged: tuple, grads: Chunks) -> None:
    """Add rank `rank`'s blocks' gradients: to its dq (grads[rank][0]) and each source's dk, dv (grads[s][1:])."""
    cp, q = len(mine), mine[rank][0]
    kernel, saved = kernel_for(q), (mine[rank][3], q, *merged)
    for step in range(cp):
        source = (rank - step) % cp
        add_to(grads[source][1:], *attend_backward(kernel, saved, mine[source][1:3], rank, source, grads[rank][0]))


def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, cp: int) -> list[torch.Tensor]:
    """The output and dq, dk, dv (fp32) of causal attention as the cp ranks of the ring compute them, in sequence
    order."""
    index, mine = split(q, k, v, dout, cp)
    merged = [rank_forward(mine, r) for r in range(cp)]
    grads = [[torch.zeros_like(t, dtype=torch.float32) for t in m[:3]] for m in mine]
    for rank in range(cp):
        rank_backward(mine, rank, merged[rank], grads)
    whole = [torch.zeros_like(t, dtype=torch.float32) for t in (q, q, k, v)]
    for i, (out, _), g in zip(index, merged, grads, strict=True):
        for w, t in zip(whole, (out, *g), strict=True):
            w[:, :, i] = t
    return whole
