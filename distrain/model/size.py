"""A model's size from its config alone, without torch: parameters and training FLOPs per token
(the driver's plan and the trainer's MFU both need them; neither should build a model for it)."""

from __future__ import annotations

from distrain.config import ModelConfig


def num_params(cfg: ModelConfig) -> int:
    """Parameters of the full model, from the config alone (no model built)."""
    head_dim = cfg.dim // cfg.n_heads
    kv = (cfg.n_kv_heads or cfg.n_heads) * head_dim
    attention = cfg.dim * cfg.dim * 2 + cfg.dim * kv * 2  # wq, wo; wk, wv
    block = attention + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim
    return 2 * cfg.vocab_size * cfg.dim + cfg.n_layers * block + cfg.dim


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, counted as PaLM does (Chowdhery et al. 2022,
    appendix B): 6·N + 12·L·H·Q·T, N the weights that multiply the token (every matrix but the embedding
    lookup), L layers, H heads of Q dimensions, T the sequence length. The attention term counts the
    scores and their weighted sum over the whole sequence, as PaLM and Megatron do (the causal mask's
    saved half is not subtracted), so MFU compares with theirs."""
    matmul_weights = num_params(cfg) - cfg.vocab_size * cfg.dim - (2 * cfg.n_layers + 1) * cfg.dim
    head_dim = cfg.dim // cfg.n_heads
    return 6 * matmul_weights + 12 * cfg.n_layers * cfg.n_heads * head_dim * seq_len
