"""GPT-2 (Radford et al. 2019): LayerNorm, GELU (tanh approximation), learned positions, biases, and the
head tied to the token embedding (model.tie_embeddings, set by the presets). Pre-norm blocks, causal
scaled_dot_product_attention with the default 1/sqrt(head_dim) scale.

Named as llama.py names its parts (tok_embeddings, layers.{i}.attention.{wq,wk,wv,wo}, feed_forward.{w1,w2},
attention_norm, ffn_norm, norm, output) plus pos_embeddings, so one tensor-parallel plan serves both
(common.megatron_plan) and the contract (contract.py) holds the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from distrain.config import ModelConfig
from distrain.model.common import CausalAttention, FamilyModel, megatron_plan
from distrain.model.families.gpt2 import FAMILY


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        kv = (cfg.n_kv_heads or cfg.n_heads) * self.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, kv)
        self.wv = nn.Linear(cfg.dim, kv)
        self.wo = nn.Linear(cfg.dim, cfg.dim)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """w2(gelu_tanh(w1 x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT2(FamilyModel):
    """The model (common.FamilyModel); it keeps the contract of contract.py."""

    family = FAMILY
    input_modules = ("tok_embeddings", "pos_embeddings")

    def __init__(self, cfg: ModelConfig, max_seq_len: int, seed: int = 0):
        super().__init__(cfg, max_seq_len, seed)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.n_positions or max_seq_len, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.ready()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            # Positions as a (1, t) batch: under sequence parallelism the table's lookup is split and
            # reduce-scattered over the sequence like the tokens' (common.megatron_plan), so the two add up.
            positions = self.positions(tokens.shape[1], tokens.device)[None]
            h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        else:
            h = tokens
        for block in self.layers.values():
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h)

    def tp_plan(self, loss_parallel: bool) -> dict[str, ParallelStyle]:
        """Megatron with sequence parallelism (common.megatron_plan)."""
        return megatron_plan(self, loss_parallel, attention_args=0)

    def grid_tp_plan(self) -> None:
        """None: the grid layers (distrain/parallel/tpnd/) have no biases, LayerNorm or positions yet."""
        return None
