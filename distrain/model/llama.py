"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, scaled_dot_product_attention.

Laid out for the parallelisms that attach to it: every projection is its own named `nn.Linear`
(`attention.wq/wk/wv/wo`, `feed_forward.w1/w2/w3`) for tensor-parallel plans, and the blocks
live in an `nn.ModuleDict` keyed by layer index so a pipeline stage can drop the blocks, the
embedding or the head it does not own and keep every remaining name unchanged (`None` parts
are skipped in `forward`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from distrain.config import ModelConfig
from distrain.model.common import CausalAttention, FamilyModel, megatron_plan
from distrain.model.families.llama import FAMILY


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, (seq_len, head_dim / 2); real-valued for DTensor."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x (batch, seq, heads, head_dim) by the position's angle."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, : x.shape[1], None, :], sin[None, : x.shape[1], None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention of `head_dim`-wide heads (model.head_dim, else dim / n_heads); with model.qk_norm
    each head's Q and K are RMS-normed over its width before the rotation (Qwen3's `q_norm`, `k_norm`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.head_width()
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Attention, then `feed_forward` (the MLP, or the moe family's experts), each on the normed residual stream."""

    def __init__(self, cfg: ModelConfig, feed_forward: nn.Module):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = feed_forward

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(FamilyModel):
    """The model (common.FamilyModel); it keeps the contract of contract.py."""

    family = FAMILY
    input_modules = ("tok_embeddings",)

    def __init__(self, cfg: ModelConfig, max_seq_len: int, seed: int = 0):
        super().__init__(cfg, max_seq_len, seed)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, self.feed_forward(i)) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.head_width(), max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.ready()

    def feed_forward(self, block: int) -> nn.Module:
        """Block `block`'s MLP (the moe family gives some blocks experts instead)."""
        return FeedForward(self.cfg.dim, self.cfg.ffn_dim)

    @torch.no_grad()
    def init_weights(self) -> None:
        """The parameters' initial values, and the rotary tables again: after `to_empty` they hold garbage."""
        super().init_weights()
        cos, sin = rotary_tables(self.cfg.head_width(), self.max_seq_len, self.cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = self.rope_cos, self.rope_sin
        if self.sequence_split is not None:  # context parallelism: the rows of this rank's positions
            at = self.positions(len(cos), cos.device)
            cos, sin = cos[at], sin[at]
        for block in self.layers.values():
            h = block(h, cos, sin)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h)

    def tp_plan(self, loss_parallel: bool) -> dict[str, ParallelStyle]:
        """Megatron with sequence parallelism (common.megatron_plan); attention also takes the rotary tables."""
        return megatron_plan(self, loss_parallel, attention_args=2)

    def grid_tp_plan(self) -> dict[str, str] | None:
        """The plan for 2-D, 2.5-D and 3-D tensor parallelism (distrain/parallel/tpnd/): every weight's role.
        "in" projections read the residual stream, "out" projections write to it; the grid decides how
        each is split. Attention's heads follow Q, K and V's output features, so each rank keeps whole
        heads. Parts a pipeline stage dropped are left out. None with a tied head (the grid splits the
        embedding and the head differently) or with model.qk_norm (no role sums the per-head gains' gradients
        over the ranks holding the other heads and rows)."""
        if self.tied_parameters or self.cfg.qk_norm:
            return None
        plan = {"tok_embeddings": "embedding"} if self.tok_embeddings is not None else {}
        if self.output is not None:
            plan |= {"norm": "norm", "output": "in"}
        for name in self.layers:
            block = f"layers.{name}"
            plan |= {f"{block}.attention_norm": "norm", f"{block}.ffn_norm": "norm"}
            plan |= {f"{block}.attention.{w}": "in" for w in ("wq", "wk", "wv")} | {f"{block}.attention.wo": "out"}
            plan |= {f"{block}.feed_forward.{w}": "in" for w in ("w1", "w3")} | {f"{block}.feed_forward.w2": "out"}
        return plan
