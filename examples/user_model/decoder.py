"""A small decoder distrain does not ship: learned positions, one fused QKV projection, RMSNorm and a
squared-ReLU MLP. It keeps distrain's model contract (distrain/model/contract.py), so every
data-parallel strategy and pipeline parallelism train it with no change to distrain:

    PYTHONPATH=examples .venv/bin/python jobs/train.py model._target_=user_model.decoder.Decoder \\
        model.name=decoder model.dim=64 model.n_layers=4 model.n_heads=4 model.ffn_dim=256 strategy=zero3

It brings no tensor-parallel plan (`tp_plan` returns None), so distrain refuses strategy.tp > 1 for it.
With `model.moe.num_experts=N` its blocks take distrain's mixture-of-experts layer in place of their MLP, and so
train under expert parallelism too (`strategy.ep`), balanced and logged as the shipped moe family is.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from distrain.config import ModelConfig
from distrain.model.contract import fill_parameters
from distrain.model.moe import MoE, reset_routers


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads = cfg.n_heads
        self.norm1, self.norm2 = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps), nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        # Experts (model.moe.num_experts > 0): distrain's layer, which its balancing and expert parallelism find
        self.moe = MoE(cfg) if cfg.moe.num_experts else None
        if self.moe is None:
            self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
            self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + (self.moe(h) if self.moe is not None else self.down(F.relu(self.up(h)).square()))


class Decoder(nn.Module):
    # The contract: modules before the blocks (first pipeline stage) and after them (last stage) ...
    input_modules = ("embed", "positions")
    output_modules = ("final_norm", "head")
    tied_parameters = ()  # ... and no parameter shared between them.

    def __init__(self, cfg: ModelConfig, max_seq_len: int, seed: int = 0):
        super().__init__()
        self.cfg, self.seed = cfg, seed
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.positions = nn.Embedding(cfg.n_positions or max_seq_len, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})  # the blocks, in order
        self.final_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if not self.head.weight.is_meta:  # built on a real device: with its weights (on meta: after placement)
            self.init_weights()

    def init_weights(self) -> None:
        """Each weight from (seed, its name) alone, so every layout starts from the same model."""

        def value(name: str, shape: torch.Size) -> torch.Tensor:
            if "norm" in name:
                return torch.ones(shape)
            generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))
            return torch.randn(shape, generator=generator) * self.cfg.init_std

        fill_parameters(self, value)
        reset_routers(self)  # the experts' loss-free bias and figures, buffers no parameter fill sets

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage without the input (output) modules has them set to None: pass hidden states on.
        if self.embed is not None:
            h = self.embed(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        else:
            h = tokens
        for block in self.layers.values():
            h = block(h)
        return self.head(self.final_norm(h)) if self.head is not None else h

    def tp_plan(self, loss_parallel: bool) -> None:
        return None

    def grid_tp_plan(self) -> None:
        return None

    def flops_per_token(self, seq_len: int) -> float:
        """6 × the weights that multiply a token, plus attention's scores and weighted sum (PaLM's count)."""
        c, m = self.cfg, self.cfg.moe
        mlp = 2 * c.dim * c.ffn_dim  # with experts: the router, and the top_k (and shared) experts a token passes
        if m.num_experts:
            mlp = c.dim * m.num_experts + 3 * c.dim * (m.expert_dim or c.ffn_dim) * (m.top_k + m.shared_experts)
        weights = c.n_layers * (4 * c.dim * c.dim + mlp) + c.vocab_size * c.dim
        return 6 * weights + 12 * c.n_layers * c.dim * seq_len
