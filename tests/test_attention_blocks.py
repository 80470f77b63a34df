"""Ring attention's blocks (distrain/parallel/attention_blocks.py) and its schedule (ring_attention.py), in one
process: every cp rank's steps run here in turn, each block by the kernel sdpa picks (the CPU's flash attention)
and by the math fallback (sdpa limited to its math path), and give sdpa's output and gradients on the whole
sequence to 1e-5 (fp32; distrain/testing/ring.py). The processes, the exchanges and the training steps:
tests/test_context_parallel.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, KV, D = 2, 4, 2, 8  # grouped-query: each K/V head serves two query heads
TOL = 1e-5


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("backend", ["fused", "math"])
def test_the_ring_of_blocks_gives_sdpa_on_the_whole_sequence(backend: str, cp: int, monkeypatch):
    """The schedule (the causal block at home, an earlier rank's front chunk, a later rank's chunks for the back
    queries), the fp32 merge, and each block's backward given the merged output and lse: exact, with both kernels
    (the math one 4 query rows a tile, so its blocks take several)."""
    from distrain.parallel import attention_blocks
    from distrain.testing.ring import ring

    monkeypatch.setattr(attention_blocks, "TILE", 4)
    t = 2 * cp * 6
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(B, H, t, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, KV, t, D, generator=g) for _ in range(2))
    want = [x.clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*want, is_causal=True, enable_gqa=True)
    out.backward(dout)
    limit = sdpa_kernel(SDPBackend.MATH) if backend == "math" else contextlib.nullcontext()
    with limit:
        assert attention_blocks.kernel_for(q).backend == (
            SDPBackend.MATH if backend == "math" else SDPBackend.FLASH_ATTENTION
        )
        got = ring(q, k, v, dout, cp)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (out, *(x.grad for x in want)), strict=True):
        assert (a - b).abs().max() <= TOL, f"{backend} cp {cp}: {name} off by {(a - b).abs().max():.2e}"


@pytest.mark.parametrize(
    "backend", [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
)
def test_the_cuda_kernels_are_called_as_their_ops_take_them(backend: SDPBackend):
    """No GPU here: the CUDA ops' meta kernels (shapes only) check each call's arguments and what comes back:
    the lse (b, heads, rows) whatever the op's own shape, the K/V gradients on K/V's heads. Their numbers on a
    GPU: jobs/gpu_check.py's ring part."""
    from distrain.parallel.attention_blocks import Kernel

    kernel = Kernel(backend)
    q, dout = (torch.empty(B, H, 40, 64, device="meta", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.empty(B, KV, 24, 64, device="meta", dtype=torch.bfloat16) for _ in range(2))
    out, lse = kernel.forward(q, k, v, False, 0.125)
    assert out.shape == q.shape and lse.shape == (B, H, 40) and lse.dtype == torch.float32
    grads = kernel.backward(dout, q, k, v, out, lse, False, 0.125)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize(
    ("choice", "device", "head_dim", "kernel"),
    [
        (SDPBackend.FLASH_ATTENTION, "cpu", 20, SDPBackend.FLASH_ATTENTION),  # the CPU op takes any head size
        (SDPBackend.FLASH_ATTENTION, "cuda", 64, SDPBackend.FLASH_ATTENTION),
        (SDPBackend.FLASH_ATTENTION, "cuda", 20, SDPBackend.MATH),  # sdpa pads it to 24; the op does not
        (SDPBackend.EFFICIENT_ATTENTION, "cuda", 20, SDPBackend.EFFICIENT_ATTENTION),
        (SDPBackend.CUDNN_ATTENTION, "cuda", 128, SDPBackend.CUDNN_ATTENTION),
        (SDPBackend.MATH, "cuda", 64, SDPBackend.MATH),
        (SDPBackend.OVERRIDEABLE, "xpu", 64, SDPBackend.MATH),  # another device's fused op: not called here
    ],
)
def test_each_choice_of_sdpa_gets_the_kernel_that_takes_it(choice, device: str, head_dim: int, kernel):
    from distrain.parallel.attention_blocks import backend_for

    assert backend_for(choice, device, head_dim) == kernel
