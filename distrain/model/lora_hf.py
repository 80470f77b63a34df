"""LoRA adapters (lora.py) out to Hugging Face: the adapter alone as PEFT writes one (`adapter_config.json` beside
`adapter_model.safetensors`, which `peft.PeftModel.from_pretrained` loads onto the base model in `transformers`),
or merged into the base weights (then exported as any model is, hf.to_hf).

An adapter follows its base weight's rule of the family's mapping (families/: `Rule`): the HF module it lives in
is the rule's tensor less `.weight`, B's rows take the rule's per-head order (Llama's Q and K), and where HF fuses
several distrain weights into one module (GPT-2's c_attn holds Q, K and V) their adapters are one of the summed
rank: A stacked, B block-diagonal (PEFT's rank_pattern and alpha_pattern keep alpha / rank), which computes the same.
"""

from __future__ import annotations

import torch
from torch import nn

from distrain.config import ConfigError, LoRAConfig, ModelConfig
from distrain.model.hf import hf_mapping, hf_rows
from distrain.model.lora import LoRALinear, adapted, is_adapter

PREFIX = "base_model.model."  # PEFT's name for the base model inside its wrapper


def adapter_files(model: nn.Module, cfg: ModelConfig, lora: LoRAConfig, base: str | None) -> tuple[dict, dict]:
    """(adapter_config.json's content, adapter_model.safetensors' tensors) of the adapted `model` (whole tensors,
    one process); `base`: the base model's directory, which PEFT records and loads the adapter onto."""
    layers = {f"{name}.weight": layer for name, layer in adapted(model)}
    found, tensors, ranks = set(), {}, {}
    for rule in hf_mapping(cfg).rules(cfg):
        held = [layers.get(n) for n in rule.names]
        if not any(held) or rule.expert is not None:
            continue
        found |= {n for n, layer in zip(rule.names, held, strict=True) if layer is not None}
        a, b = zip(*(_pieces(layer, layers, rule.names, lora.rank) for layer in held), strict=True)
        module = rule.hf.removesuffix(".weight")
        tensors[f"{PREFIX}{module}.lora_A.weight"] = torch.cat(a).contiguous()
        tensors[f"{PREFIX}{module}.lora_B.weight"] = hf_rows(rule, torch.block_diag(*b)).contiguous()
        ranks[module] = lora.rank * len(rule.names)
    missing = sorted(set(layers) - found)
    if missing:
        raise ConfigError(f"{missing[0]}'s adapter has no place in a Hugging Face model; export it with merge=true")
    fused = {m: r for m, r in ranks.items() if r != lora.rank}
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(ranks),
        "rank_pattern": fused,
        "alpha_pattern": {m: lora.alpha * r / lora.rank for m, r in fused.items()},
        "fan_in_fan_out": any(rule.conv1d for rule in hf_mapping(cfg).rules(cfg)),
        "bias": "none",
        "init_lora_weights": True,
        "use_rslora": False,
        "inference_mode": True,
    }
    return config, tensors


def _pieces(layer: LoRALinear | None, layers: dict, names: tuple, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight's (A, B) in a fused module: its adapter's, or zeros of the rank for one without."""
    if layer is not None:
        return layer.lora_A.detach(), layer.lora_B.detach()
    like = next(v for v in (layers.get(n) for n in names) if v is not None)
    return torch.zeros(rank, like.in_features), torch.zeros(like.out_features, rank)


@torch.no_grad()
def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every adapter added into its weight (W + alpha/rank · B A), the adapters left
    out: the base model's names, as hf.to_hf and a model without adapters take them."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if not is_adapter(k)}
    for name, layer in adapted(model):
        state[f"{name}.weight"] += layer.delta()
    return state
