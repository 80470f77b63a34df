"""From `model._target_` to a model keeping the contract (contract.py), or a one-line ConfigError.

`model=<name>` presets (conf/model/) name a shipped family's target; `model._target_=pkg.module.fn`
names a user's own class or function, imported as distrain/target.py imports any target.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distrain.config import ConfigError, ModelConfig
from distrain.model.families import FAMILIES, shipped
from distrain.target import import_target


def resolve(target: str) -> Callable[..., Any]:
    """The class or function `target` names (a dotted path), or a ConfigError saying why not."""
    fn = import_target(target, "model._target_", FAMILIES)
    if not callable(fn):
        raise ConfigError(
            f"model._target_={target}: {target} is a {type(fn).__name__}, not a class or function to call "
            f"(cfg, max_seq_len, seed)"
        )
    return fn


def build_model(cfg: ModelConfig, max_seq_len: int, seed: int = 0) -> Any:
    """`cfg._target_(cfg, max_seq_len, seed)`, checked against the contract. Under `with
    torch.device("meta")` it allocates nothing (the layout materialises it)."""
    from distrain.model.contract import missing_part

    model = resolve(cfg._target_)(cfg, max_seq_len, seed)
    missing = missing_part(model)
    if missing is not None:
        raise ConfigError(f"model._target_={cfg._target_}: the model lacks {missing} (see distrain/model/contract.py)")
    return model


def check_model(cfg: ModelConfig, max_seq_len: int) -> None:
    """The driver's check before any worker starts: a shipped family needs none (and no torch import);
    a user's target is imported and built on the meta device, which costs no memory."""
    if shipped(cfg._target_) is None:
        meta_model(cfg, max_seq_len)


def has_plan(cfg: ModelConfig, max_seq_len: int, mode: str) -> bool:
    """Whether the model has a tensor-parallel plan for strategy.tp_mode=`mode`: `tp_plan` (1d) or
    `grid_tp_plan` (2d, 2.5d, 3d) not None."""
    family = shipped(cfg._target_)
    if family is not None:
        return family.tp if mode == "1d" else family.grid_tp and not (cfg.tie_embeddings or cfg.qk_norm)
    model = meta_model(cfg, max_seq_len)
    return (model.tp_plan(True) if mode == "1d" else model.grid_tp_plan()) is not None


def has_causal_attention(cfg: ModelConfig, max_seq_len: int) -> bool:
    """Whether context parallelism can split the model's attention: it computes it in common.CausalAttention
    modules (the shipped families do)."""
    if shipped(cfg._target_) is not None:
        return True
    from distrain.model.common import CausalAttention

    return any(isinstance(m, CausalAttention) for m in meta_model(cfg, max_seq_len).modules())


def meta_linears(cfg: ModelConfig, max_seq_len: int) -> tuple[dict[str, tuple[int, int]], tuple[str, ...]]:
    """A model's nn.Linear modules' (in, out) features by name, built on the meta device, and its output modules."""
    from torch import nn

    model = meta_model(cfg, max_seq_len)
    found = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return found, tuple(model.output_modules)


def meta_experts(cfg: ModelConfig, max_seq_len: int) -> dict[str, tuple[int, int, int]]:
    """A model's routed experts (model/moe.py's Experts) by name, (experts, dim, hidden), built on the meta device."""
    from distrain.model.moe import Experts

    model = meta_model(cfg, max_seq_len)
    return {n: tuple(m.w2.shape) for n, m in model.named_modules() if isinstance(m, Experts)}


def meta_model(cfg: ModelConfig, max_seq_len: int) -> Any:
    """The model built on the meta device: its shape and methods, no memory."""
    import torch

    with torch.device("meta"):
        return build_model(cfg, max_seq_len)
