"""A model's size: parameters and training FLOPs per token. The driver's plan and the trainer's MFU
both need them; for a shipped family they come from its record (families/) and the config alone,
without torch (the driver starts faster without it); a user's model is built on the meta device and
asked (contract.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from distrain.config import ModelConfig
from distrain.model.families import Family, shipped
from distrain.model.families.family import OUTPUT_MODULES, Linears


def num_params(cfg: ModelConfig, seq_len: int | None = None) -> int:
    """Parameters of the full model (a tied pair once); `seq_len` sizes a positions' table without n_positions."""
    family = shipped(cfg._target_)
    if family is None:
        return sum(p.numel() for p in _built(cfg, seq_len or cfg.n_positions or 1).parameters())  # a tie once
    return family.matmul_weights(cfg) + family.other_params(cfg) + _positions_table(family, cfg, seq_len)


def _positions_table(family: Family, cfg: ModelConfig, seq_len: int | None) -> int:
    """A learned positions' table: model.n_positions rows, else the run's sequence length."""
    if not family.learned_positions:
        return 0
    rows = cfg.n_positions or seq_len
    if rows is None:
        raise ValueError("model.n_positions is unset: pass the run's seq_len")
    return rows * cfg.dim


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len` (families/family.py)."""
    family = shipped(cfg._target_)
    if family is None:
        return float(_built(cfg, seq_len).flops_per_token(seq_len))
    return family.flops_per_token(cfg, seq_len)


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
    family = shipped(cfg._target_)
    if family is None:
        return _counted_parts(_built(cfg, seq_len))
    block, bare = replace(cfg, n_layers=1, vocab_size=0), replace(cfg, n_layers=0, vocab_size=0)
    head_vector = family.other_params(bare)  # the final norm
    vocab = cfg.vocab_size * cfg.dim
    tied = vocab if cfg.tie_embeddings else 0
    return Parts(
        (vocab + _positions_table(family, cfg, seq_len), 0),
        (family.matmul_weights(block), family.other_params(block) - head_vector),
        (vocab - tied, head_vector),
        tied,
    )


def _counted_parts(model) -> Parts:  # noqa: ANN001  (an nn.Module)
    aliases = {a for a, _ in model.tied_parameters}

    def count(names: tuple[str, ...], skip: set[str]) -> tuple[int, int]:
        params = [p for n in names for k, p in model.get_submodule(n).named_parameters(prefix=n) if k not in skip]
        return sum(p.numel() for p in params if p.dim() > 1), sum(p.numel() for p in params if p.dim() <= 1)

    tied = sum(model.get_parameter(a).numel() for a in aliases)
    return Parts(
        count(model.input_modules, set()), count(("layers.0",), set()), count(model.output_modules, aliases), tied
    )


def linears(cfg: ModelConfig, seq_len: int) -> tuple[Linears, tuple[str, ...]]:
    """Every nn.Linear's (in, out) features by full-model name, and the model's output modules (float8's `--plan`)."""
    family = shipped(cfg._target_)
    if family is not None:
        return family.linears(cfg), OUTPUT_MODULES
    from distrain.model.registry import meta_linears

    return meta_linears(cfg, seq_len)


def routed_experts(cfg: ModelConfig, seq_len: int) -> dict[str, tuple[int, int, int]]:
    """Each block's routed experts (model/moe.py's Experts) by full-model name: (experts, dim, hidden)."""
    family = shipped(cfg._target_)
    if family is not None:
        return family.routed_experts(cfg) if family.routed_experts else {}
    from distrain.model.registry import meta_experts

    return meta_experts(cfg, seq_len)


def _built(cfg: ModelConfig, seq_len: int):  # noqa: ANN202  (an nn.Module; torch stays unimported here)
    from distrain.model.registry import meta_model

    return meta_model(cfg, seq_len)
