"""One block of ring attention (ring_attention.py): some of a rank's queries against one chunk's keys and values,
computed by the kernel F.scaled_dot_product_attention would pick for them, called through the aten op that also
returns the row's log-sum-exp, which the ring needs to merge the blocks: on the CPU the flash-attention op for
CPU, on CUDA flash, memory-efficient or cuDNN attention. torch.distributed.tensor.experimental.context_parallel
calls the same CUDA ops; it has no CPU path, so it cannot run on gloo.

A block's backward is given the merged output and log-sum-exp of the whole row, not the block's own: the
probabilities it recomputes, exp(scores − lse), are then the row's softmax restricted to the block, and the
blocks' gradients sum to the exact gradient, as a fused kernel's backward does over its own key tiles.

Where sdpa would pick its math path (a head size or dtype no fused kernel takes on the device, or
`torch.nn.attention.sdpa_kernel` limiting sdpa to it), or a fused op this file does not call (`backend_for`),
the block runs as plain matmuls in fp32, TILE query rows at a time, so that what it holds grows with the
chunk, not its square.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

from distrain.strategy.context_parallel import TILE

aten = torch.ops.aten
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: each K/V head serves heads / kv_heads query heads."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of an expanded K/V, summed back onto its kv_heads heads."""
    return grad if grad.shape[1] == kv_heads else grad.unflatten(1, (kv_heads, -1)).sum(2)


@dataclass(frozen=True)
class Kernel:
    """A block's forward (its output in q's dtype, in fp32 from the math fallback; its log-sum-exp in fp32,
    (b, heads, rows)) and backward."""

    backend: SDPBackend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> tuple:
        b = self.backend
        if b == SDPBackend.MATH:
            return _math_forward(q, _expand(k, q.shape[1]), _expand(v, q.shape[1]), causal, scale)
        if q.device.type == "cpu":  # grouped-query heads taken as they are
            return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
        if b == SDPBackend.FLASH_ATTENTION:
            return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        if b == SDPBackend.EFFICIENT_ATTENTION:
            out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
            return out, lse[..., : q.shape[2]]  # its rows padded to a multiple of 32
        out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        return out, lse.squeeze(-1)  # (b, heads, rows, 1)

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> Grads:
        """dq, dk, dv of the block given the row's merged `out` and `lse`; dk, dv on K/V's own heads."""
        b, kv_heads = self.backend, k.shape[1]
        if q.device.type == "cpu" and b != SDPBackend.MATH:
            args = (dout, q, k, v, out, lse, 0.0, causal)
            return aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, scale=scale)
        k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
        rows, keys = q.shape[2], k.shape[2]
        if b == SDPBackend.MATH:
            dq, dk, dv = _math_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        elif b == SDPBackend.FLASH_ATTENTION:
            rng = _unused_rng(q.device, (2,), torch.uint64)
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, None, None, rows, keys, 0.0, causal, *rng, scale=scale
            )
        elif b == SDPBackend.EFFICIENT_ATTENTION:
            padded = torch.nn.functional.pad(lse, (0, -rows % 32))
            rng = _unused_rng(q.device, (), torch.long)
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                dout, q, k, v, None, out, padded, *rng, 0.0, [True, True, True, False], causal, scale=scale
            )
        else:
            rng = _unused_rng(q.device, (), torch.long)
            dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, k, v, out, lse.unsqueeze(-1), *rng, None, None, None, rows, keys, 0.0, causal, scale=scale
            )
        return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)


def _unused_rng(device: torch.device, shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The dropout seed and offset a CUDA kernel's backward takes, unread without dropout."""
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros((), dtype=dtype, device=device)


FUSED = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)


def backend_for(choice: SDPBackend, device: str, head_dim: int) -> SDPBackend:
    """The block kernel for sdpa's choice: the same fused kernel, or the math fallback where sdpa would run its
    math path, where the fused kernel is another device's than the CPU's or CUDA's, and for CUDA's flash op at a
    head size that is not a multiple of 8 (sdpa pads it; the op does not)."""
    if choice not in FUSED or device not in ("cpu", "cuda"):
        return SDPBackend.MATH
    if device == "cuda" and choice == SDPBackend.FLASH_ATTENTION and head_dim % 8:
        return SDPBackend.MATH
    return choice


def kernel_for(q: torch.Tensor) -> Kernel:
    """The kernel sdpa would run causal attention with on q's device, dtype and head size, asked as for a
    training step (the gradient wanted), with K/V as Q (a CUDA kernel is given them expanded to Q's heads)."""
    with torch.enable_grad():
        probe = q.detach().requires_grad_()
        choice = SDPBackend(torch._fused_sdp_choice(probe, probe, probe, is_causal=True))
    return Kernel(backend_for(choice, q.device.type, q.shape[-1]))


def _tiles(rows: int, keys: int, causal: bool) -> Iterator[tuple[slice, slice]]:
    """Each tile of a block's query rows, and the keys it sees: all, or under the causal mask up to its last row."""
    for start in range(0, rows, TILE):
        stop = min(start + TILE, rows)
        yield slice(start, stop), slice(0, stop if causal else keys)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, first_row: int) -> torch.Tensor:
    """Scaled scores of query rows first_row.. against keys 0..; masked above the diagonal when causal."""
    s = q.float() @ k.float().transpose(-2, -1) * scale
    if causal:
        above = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(first_row + 1)
        s = s.masked_fill(above, float("-inf"))  # one (rows, keys) mask for every sequence and head
    return s


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> tuple:
    out, lse = torch.empty_like(q, dtype=torch.float32), q.new_empty(q.shape[:-1], dtype=torch.float32)
    for rows, keys in _tiles(q.shape[2], k.shape[2], causal):
        s = _scores(q[:, :, rows], k[:, :, keys], causal, scale, rows.start)
        lse[:, :, rows] = s.logsumexp(-1)
        out[:, :, rows] = (s - lse[:, :, rows, None]).exp() @ v[:, :, keys].float()
    return out, lse


def _math_backward(*block: torch.Tensor, causal: bool, scale: float) -> Grads:
    dout, q, k, v, out, lse = block
    dout = dout.float()
    delta = (dout * out.float()).sum(-1)  # D = rowsum(dO ∘ O)
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
    for rows, keys in _tiles(q.shape[2], k.shape[2], causal):
        q_, do, k_, v_ = q[:, :, rows].float(), dout[:, :, rows], k[:, :, keys].float(), v[:, :, keys].float()
        p = (_scores(q_, k_, causal, scale, rows.start) - lse[:, :, rows, None]).exp()
        dv[:, :, keys] += p.transpose(-2, -1) @ do
        ds = p * (do @ v_.transpose(-2, -1) - delta[:, :, rows, None])
        dq[:, :, rows] = ds @ k_ * scale
        dk[:, :, keys] += ds.transpose(-2, -1) @ q_ * scale
    return dq, dk, dv
