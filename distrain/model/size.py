"""A model's size: parameters and training FLOPs per token. The driver's plan and the trainer's MFU
both need them; for the shipped families they come from the config alone, without torch (the driver
starts faster without it); a user's model is built on the meta device and asked (contract.py).

FLOPs are counted as PaLM does (Chowdhery et al. 2022, appendix B): 6·N + 12·L·H·Q·T, N the weights
that multiply the token (every matrix but the embedding lookups; the head counts even when tied), L
layers, H heads of Q dimensions, T the sequence length. The attention term counts the scores and their
weighted sum over the whole sequence, as PaLM and Megatron do, so MFU compares with theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from distrain.config import ModelConfig


@dataclass(frozen=True)
class Family:
    """A shipped family's sizes from its config: (weights multiplying a token, other parameters)."""

    matmul_weights: Callable[[ModelConfig], int]
    other_params: Callable[[ModelConfig, int], int]  # (cfg, positions' table rows)
    grid_tp: bool  # has a plan for 2-D/2.5-D/3-D tensor parallelism


def _attention_weights(cfg: ModelConfig) -> int:
    kv = (cfg.n_kv_heads or cfg.n_heads) * (cfg.dim // cfg.n_heads)
    return cfg.dim * cfg.dim * 2 + cfg.dim * kv * 2  # wq, wo; wk, wv


def _llama_matmul(cfg: ModelConfig) -> int:
    return cfg.n_layers * (_attention_weights(cfg) + 3 * cfg.dim * cfg.ffn_dim) + cfg.vocab_size * cfg.dim


def _llama_other(cfg: ModelConfig, positions: int) -> int:
    embedding = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    return embedding + (2 * cfg.n_layers + 1) * cfg.dim  # norms' gains


def _gpt2_matmul(cfg: ModelConfig) -> int:
    return cfg.n_layers * (_attention_weights(cfg) + 2 * cfg.dim * cfg.ffn_dim) + cfg.vocab_size * cfg.dim


def _gpt2_other(cfg: ModelConfig, positions: int) -> int:
    kv = (cfg.n_kv_heads or cfg.n_heads) * (cfg.dim // cfg.n_heads)
    biases = 2 * cfg.dim + 2 * kv + cfg.ffn_dim + cfg.dim  # wq, wo; wk, wv; w1; w2
    norms = (2 * cfg.n_layers + 1) * 2 * cfg.dim  # LayerNorm: gain and bias
    embedding = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    return embedding + positions * cfg.dim + cfg.n_layers * biases + norms


SHIPPED = {
    "distrain.model.llama.Transformer": Family(_llama_matmul, _llama_other, grid_tp=True),
    "distrain.model.gpt2.GPT2": Family(_gpt2_matmul, _gpt2_other, grid_tp=False),
}


def positions(cfg: ModelConfig, seq_len: int | None) -> int:
    """Rows of a learned positions' table: model.n_positions, else the run's sequence length."""
    rows = cfg.n_positions or seq_len
    if rows is None:
        raise ValueError("model.n_positions is unset: pass the run's seq_len")
    return rows


def num_params(cfg: ModelConfig, seq_len: int | None = None) -> int:
    """Parameters of the full model (a tied pair once); `seq_len` sizes a positions' table without n_positions."""
    family = SHIPPED.get(cfg._target_)
    if family is None:
        from distrain.model.contract import count_parameters

        return count_parameters(_built(cfg, seq_len or cfg.n_positions or 1))
    rows = positions(cfg, seq_len) if cfg._target_.endswith("GPT2") else 0
    return family.matmul_weights(cfg) + family.other_params(cfg, rows)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len` (module docstring)."""
    family = SHIPPED.get(cfg._target_)
    if family is None:
        return float(_built(cfg, seq_len).flops_per_token(seq_len))
    return family_flops(family.matmul_weights(cfg), cfg, seq_len)


def family_flops(matmul_weights: int, cfg: ModelConfig, seq_len: int) -> float:
    """6·N + 12·L·H·Q·T: a model of the usual decoder shape may compute its own with this."""
    return 6 * matmul_weights + 12 * cfg.n_layers * cfg.n_heads * (cfg.dim // cfg.n_heads) * seq_len


@dataclass(frozen=True)
class Parts:
    """Parameters by where a layout puts them, each (in matrices, in vectors): tensor parallelism splits
    matrices and leaves most vectors whole. `tied`: the parameters an alias shares with the input
    modules, which a pipeline's last stage holds as a copy of its own."""

    input: tuple[int, int]
    block: tuple[int, int]
    output: tuple[int, int]
    tied: int


def parts(cfg: ModelConfig, seq_len: int) -> Parts:
    """The model's parameters split as a pipeline splits them: first stage, each block, last stage."""
    if cfg._target_ not in SHIPPED:
        return _counted_parts(_built(cfg, seq_len))
    gpt2 = cfg._target_.endswith("GPT2")
    matrix = SHIPPED[cfg._target_].matmul_weights(replace(cfg, n_layers=1, vocab_size=0))
    vector = num_params(replace(cfg, n_layers=1, vocab_size=0, n_positions=1), 1) - matrix
    vector -= num_params(replace(cfg, n_layers=0, vocab_size=0, n_positions=1), 1)
    vocab = cfg.vocab_size * cfg.dim
    first = vocab + (positions(cfg, seq_len) * cfg.dim if gpt2 else 0)
    head_vector = 2 * cfg.dim if gpt2 else cfg.dim
    tied = vocab if cfg.tie_embeddings else 0
    return Parts((first, 0), (matrix, vector), (vocab - tied, head_vector), tied)


def _counted_parts(model) -> Parts:  # noqa: ANN001  (an nn.Module)
    aliases = {a for a, _ in model.tied_parameters}

    def count(names: tuple[str, ...], skip: set[str]) -> tuple[int, int]:
        params = [p for n in names for k, p in model.get_submodule(n).named_parameters(prefix=n) if k not in skip]
        return sum(p.numel() for p in params if p.dim() > 1), sum(p.numel() for p in params if p.dim() <= 1)

    tied = sum(model.get_parameter(a).numel() for a in aliases)
    return Parts(
        count(model.input_modules, set()), count(("layers.0",), set()), count(model.output_modules, aliases), tied
    )


def _built(cfg: ModelConfig, seq_len: int):  # noqa: ANN202  (an nn.Module; torch stays unimported above)
    import torch

    from distrain.model.registry import build_model

    with torch.device("meta"):
        return build_model(cfg, seq_len)
