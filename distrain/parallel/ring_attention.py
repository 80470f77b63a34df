"""Ring attention over the cp group, with the communication in plain view.

Each rank holds two chunks of every sequence (distrain/strategy/context_parallel.py's load-balanced split:
chunks r and 2·cp−1−r of 2·cp). Its queries meet every rank's keys and values in cp steps: at each step it
starts passing the K/V it holds to the next rank (isend/irecv round the ring) and, while they travel,
attends its queries to them; a query chunk sees a key chunk whole when that comes earlier in the sequence,
under the causal mask when it is the same chunk, and not at all when it comes later. The partial outputs
are merged with the log-sum-exp correction: o = Σ_j exp(lse_j − lse)·o_j, lse = log Σ_j exp(lse_j).

The backward (a custom autograd.Function) runs the ring again: K/V travel as in the forward, and with
them the gradients of K and V accumulated so far, which end, after one more step, at the rank that owns
them. Only q, k, v, the output and the lse are kept for it: the scores are recomputed block by block, and
within a block TILE query rows at a time, so what a step holds beside them grows with the chunk, not its square.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from distrain.strategy.context_parallel import TILE

Pairs = list[tuple[int, int, bool]]  # (local query chunk, local key chunk, causal) for one block of K/V


def pairs(rank: int, source: int, cp: int) -> Pairs:
    """Which of this rank's query chunks attend to which of `source`'s key chunks, and how."""
    mine, theirs = (rank, 2 * cp - 1 - rank), (source, 2 * cp - 1 - source)
    return [(a, b, ga == gb) for a, ga in enumerate(mine) for b, gb in enumerate(theirs) if gb <= ga]


def pass_on(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> tuple[list[torch.Tensor], list]:
    """Start sending `tensors` to the next rank of the ring and receiving the previous rank's; the
    received tensors are valid once the returned requests are waited on."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    after, before = (dist.get_global_rank(group, (rank + d) % size) for d in (1, -1))
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, after, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, before, group) for t in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _tiles(n: int, causal: bool) -> Iterator[tuple[slice, slice]]:
    """Each tile of a chunk's n query rows, and the keys it sees: all, or under the causal mask up to its last row."""
    for start in range(0, n, TILE):
        stop = min(start + TILE, n)
        yield slice(start, stop), slice(0, stop if causal else n)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, first_row: int) -> torch.Tensor:
    """Scaled scores of query rows first_row.. against keys 0..; masked above the diagonal when causal."""
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        above = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(first_row + 1)
        s = s.masked_fill(above, float("-inf"))  # one (rows, keys) mask for every sequence and head
    return s


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: each K/V head serves heads / kv_heads query heads."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of an expanded K/V, summed back onto its kv_heads heads."""
    return grad if grad.shape[1] == kv_heads else grad.unflatten(1, (kv_heads, -1)).sum(2)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):  # fp32 math whatever the block runs in
            return RingAttention._forward(ctx, q, k, v, group)

    @staticmethod
    def _forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        heads, scale = q.shape[1], 1.0 / math.sqrt(q.shape[-1])
        qs = q.float().chunk(2, dim=2)
        out = [torch.zeros_like(c) for c in qs]
        lse = [torch.full(c.shape[:-1], float("-inf"), device=q.device) for c in qs]
        held = [k, v]  # travel as they came (bf16 under autocast); each block's math in fp32
        for step in range(cp):
            requests = []
            if step < cp - 1:
                incoming, requests = pass_on(held, group)
            ks, vs = (_expand(t.float(), heads).chunk(2, dim=2) for t in held)
            for a, b, causal in pairs(rank, (rank - step) % cp, cp):
                for rows, keys in _tiles(qs[a].shape[2], causal):
                    s = _scores(qs[a][:, :, rows], ks[b][:, :, keys], causal, scale, rows.start)
                    block_lse = s.logsumexp(-1)
                    block_out = (s - block_lse[..., None]).exp() @ vs[b][:, :, keys]
                    o, seen = out[a][:, :, rows], lse[a][:, :, rows]
                    merged = torch.logaddexp(seen, block_lse)
                    o.mul_((seen - merged).exp()[..., None]).add_(block_out * (block_lse - merged).exp()[..., None])
                    seen.copy_(merged)
            _wait(requests)
            if step < cp - 1:
                held = incoming
        # laid out (b, t, heads, d) as the fused kernels lay theirs: the model's transpose back is then a view
        out_all = torch.cat(out, dim=2).to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out_all, torch.cat(lse, dim=2))
        ctx.group, ctx.scale = group, scale
        return out_all

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple:
        with torch.autocast(grad_out.device.type, enabled=False):
            return RingAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        heads = q.shape[1]
        grad_out = grad_out.float()
        delta = (grad_out * out.float()).sum(-1)  # D = rowsum(dO ∘ O)
        qs, dos, lses, deltas = (t.chunk(2, dim=2) for t in (q.float(), grad_out, lse, delta))
        dq = [torch.zeros_like(c) for c in qs]
        held = [k, v]
        grads = [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
        for step in range(cp):
            requests = []
            if step < cp - 1:
                incoming, requests = pass_on(held, group)
            ks, vs = (_expand(t.float(), heads).chunk(2, dim=2) for t in held)
            dk, dv = (torch.zeros_like(_expand(g, heads)).chunk(2, dim=2) for g in grads)
            for a, b, causal in pairs(rank, (rank - step) % cp, cp):
                for rows, keys in _tiles(qs[a].shape[2], causal):
                    q_, do, k_, v_ = qs[a][:, :, rows], dos[a][:, :, rows], ks[b][:, :, keys], vs[b][:, :, keys]
                    p = (_scores(q_, k_, causal, scale, rows.start) - lses[a][:, :, rows, None]).exp()
                    dv[b][:, :, keys].add_(p.transpose(-2, -1) @ do)
                    ds = p * (do @ v_.transpose(-2, -1) - deltas[a][:, :, rows, None])
                    dq[a][:, :, rows].add_(ds @ k_ * scale)
                    dk[b][:, :, keys].add_(ds.transpose(-2, -1) @ q_ * scale)
            grads = [g + _fold(torch.cat(d, dim=2), g.shape[1]) for g, d in zip(grads, (dk, dv), strict=True)]
            _wait(requests)
            grads, returned = pass_on(grads, group)  # on to the next rank, as its K/V go; the last step home
            _wait(returned)
            if step < cp - 1:
                held = incoming
        return torch.cat(dq, dim=2).to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None
