"""Ring attention over the cp group, with the communication in plain view.

Each rank holds two chunks of every sequence (distrain/strategy/context_parallel.py's load-balanced split:
chunks r and 2·cp−1−r of 2·cp). Its queries meet every rank's keys and values in cp steps: at each step it
starts passing the K/V it holds to the next rank (isend/irecv round the ring) and, while they travel, attends
its queries to them in one call of the device's fused attention kernel (attention_blocks.py): its own K/V under
the causal mask (its two chunks laid end to end are in sequence order, so the mask of the pair is the
sequence's); an earlier rank's front chunk with all its queries (that rank's back chunk comes after both of
its own); a later rank's two chunks with its back chunk's queries only (its front chunk comes before both).
The partial outputs are merged in fp32 with the log-sum-exp correction: o = Σ_j exp(lse_j − lse)·o_j,
lse = log Σ_j exp(lse_j).

The backward (a custom autograd.Function) runs the ring again: K/V travel as in the forward, and with them
the gradients of K and V accumulated so far, which end, after one more step, at the rank that owns them. Only
q, k, v, the output and the lse are kept for it; each block's backward is the kernel's own, given the merged
output and lse, which makes it exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distrain.parallel.attention_blocks import Kernel, kernel_for


def block(rank: int, source: int) -> tuple[int | None, int | None, bool]:
    """Which half of this rank's queries (None: both) meets which half of `source`'s K/V (None: both), and
    whether under the causal mask."""
    if source == rank:
        return None, None, True
    return (None, 0, False) if source < rank else (1, None, False)


def half(t: torch.Tensor, which: int | None) -> torch.Tensor:
    """Chunk `which` of the two a rank holds (dim 2: the sequence), or both."""
    return t if which is None else t.chunk(2, dim=2)[which]


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


def attend(
    kernel: Kernel, q: torch.Tensor, kv: list[torch.Tensor], rank: int, source: int, merged: tuple | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's queries against `source`'s K/V, merged into `merged` (out and lse in fp32, changed in
    place; None at the first block, its own, which every query sees)."""
    rows, keys, causal = block(rank, source)
    k, v = (half(t, keys) for t in kv)
    out, lse = kernel.forward(half(q, rows), k, v, causal, q.shape[-1] ** -0.5)
    if merged is None:
        return out.float(), lse
    o, seen = (half(t, rows) for t in merged)
    total = torch.logaddexp(seen, lse)
    o.mul_((seen - total).exp().unsqueeze(-1)).add_(out.float() * (lse - total).exp().unsqueeze(-1))
    seen.copy_(total)
    return merged


def attend_backward(
    kernel: Kernel, saved: tuple, kv: list[torch.Tensor], rank: int, source: int, dq: torch.Tensor
) -> tuple[int | None, torch.Tensor, torch.Tensor]:
    """The gradients of this rank's block with `source`'s K/V: dq's added to `dq` (fp32), dk and dv returned,
    with the half of `source`'s K/V they belong to (None: both); `saved` = (dout, q, out, lse) of the whole row."""
    rows, keys, causal = block(rank, source)
    dout, q, out, lse = (half(t, rows).contiguous() for t in saved)
    k, v = (half(t, keys) for t in kv)
    got = kernel.backward(dout, q, k, v, out, lse, causal, q.shape[-1] ** -0.5)
    half(dq, rows).add_(got[0])
    return keys, got[1], got[2]


def add_to(grads: list[torch.Tensor], keys: int | None, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add a block's dk, dv to the K/V gradients accumulated so far (fp32), on the half of K/V they belong to."""
    for grad, g in zip(grads, (dk, dv), strict=True):
        half(grad, keys).add_(g)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):  # the kernels in q's dtype, the merge in fp32
            return RingAttention._forward(ctx, q, k, v, group)

    @staticmethod
    def _forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        kernel, held, merged = kernel_for(q), [k, v], None
        for step in range(cp):
            requests = []
            if step < cp - 1:
                incoming, requests = pass_on(held, group)
            merged = attend(kernel, q, held, rank, (rank - step) % cp, merged)
            _wait(requests)
            if step < cp - 1:
                held = incoming
        out, lse = merged
        # laid out (b, t, heads, d) as the fused kernels lay theirs: the model's transpose back is then a view
        out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kernel = group, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple:
        with torch.autocast(grad_out.device.type, enabled=False):
            return RingAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        saved = (grad_out.to(q.dtype), q, out, lse)
        dq = torch.zeros_like(q, dtype=torch.float32)
        held, returned = [k, v], []
        grads = [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
        for step in range(cp):
            requests = []
            if step < cp - 1:
                incoming, requests = pass_on(held, group)
            keys, dk, dv = attend_backward(ctx.kernel, saved, held, rank, (rank - step) % cp, dq)
            _wait(returned)  # the K/V gradients the previous rank accumulated for this block, travelling meanwhile
            add_to(grads, keys, dk, dv)
            grads, returned = pass_on(grads, group)  # on to the next rank, as its K/V go; the last step home
            _wait(requests)
            if step < cp - 1:
                held = incoming
        _wait(returned)
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None
