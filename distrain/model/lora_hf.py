"""LoRA adapters (lora.py) out to Hugging Face: the adapter alone as PEFT writes one (`adapter_config.json` beside
`adapter_model.safetensors`, which `peft.PeftModel.from_pretrained` loads onto the base model in `transformers`),
or merged into the base weights (then exported as any model is, hf.to_hf).

An adapter follows its base weight's rule of the family's mapping (families/: `Rule`): the HF module it lives in
is the rule's tensor less `.weight`, B's rows take the rule's per-head order (Llama's Q and K), and where HF fuses
several distrain weights into one module (GPT-2's c_attn holds Q, K and V) their adapters are one of the summed
rank: A stacked, B block-diagonal (PEFT's rank_pattern and alpha_pattern keep alpha / rank), which computes the same.

A MoE block's routed experts (LoRAExperts) go to PEFT's `target_parameters`: transformers ≥ 5 holds each block's
experts as two stacked parameters, `mlp.experts.gate_up_proj` (experts, 2·hidden, dim: w1's rows, then w3's) and
`down_proj` (experts, dim, hidden: w2), in Mixtral and Qwen3-MoE alike. PEFT adapts each with one (experts · rank,
in) A and one (out, rank · experts) B, the rank index outermost in B's columns; w1's and w3's adapters fuse into
gate_up_proj's as GPT-2's Q, K and V do. PEFT wraps a module's second adapted parameter around its first, so
gate_up_proj's tensors sit under `base_layer.`.

PEFT loading onto a Qwen3-MoE renames every target called gate_proj, up_proj or down_proj to the fused experts
(their names in transformers 4), so the adapters of a Qwen3-MoE's dense blocks' MLP would load in the wrong place:
they are refused, with merge=true as the way out.
"""

from __future__ import annotations

import torch
from torch import nn

from distrain.config import ConfigError, LoRAConfig, ModelConfig
from distrain.model.hf import hf_mapping, hf_rows
from distrain.model.lora import LoRAExperts, LoRALinear, adapted, is_adapter

PREFIX = "base_model.model."  # PEFT's name for the base model inside its wrapper
# A block's routed experts in transformers, and its parameters: (name, distrain's weights in it, PEFT's nesting)
HF_EXPERTS = "model.layers.{block}.mlp.experts"
EXPERT_PARAMS = (("gate_up_proj", ("w1", "w3"), "base_layer."), ("down_proj", ("w2",), ""))
# Module names PEFT takes for a model's experts whatever they are (its transformers-v4 renaming), by architecture
READ_AS_EXPERTS = {"Qwen3MoeForCausalLM": ("gate_proj", "up_proj", "down_proj")}


def adapter_files(model: nn.Module, cfg: ModelConfig, lora: LoRAConfig, base: str | None) -> tuple[dict, dict]:
    """(adapter_config.json's content, adapter_model.safetensors' tensors) of the adapted `model` (whole tensors,
    one process); `base`: the base model's directory, which PEFT records and loads the adapter onto."""
    layers = {f"{name}.weight": layer for name, layer in adapted(model) if isinstance(layer, LoRALinear)}
    found, tensors, ranks = set(), {}, {}
    mapping = hf_mapping(cfg)
    for rule in mapping.rules(cfg):
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
    misread = sorted(m for m in ranks if m.rsplit(".", 1)[-1] in READ_AS_EXPERTS.get(mapping.architecture, ()))
    if misread:
        raise ConfigError(
            f"{misread[0]}'s adapter: peft loads every {mapping.architecture} target of that name onto the experts, "
            f"not the dense block's MLP; export with merge=true (or train finetune.lora.targets without mlp)"
        )
    experts = _expert_tensors(model)
    tensors |= experts
    fused = {m: r for m, r in ranks.items() if r != lora.rank}
    if experts:  # w1's and w3's adapters fused in gate_up_proj's: twice the rank (and alpha, keeping alpha / rank)
        fused[f"mlp.experts.{EXPERT_PARAMS[0][0]}"] = 2 * lora.rank
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0 if experts else lora.dropout,  # PEFT's target_parameters refuse any; inference has none
        "target_modules": sorted(ranks),
        "target_parameters": [f"mlp.experts.{param}" for param, _, _ in EXPERT_PARAMS] if experts else None,
        "rank_pattern": fused,
        "alpha_pattern": {m: lora.alpha * r / lora.rank for m, r in fused.items()},
        "fan_in_fan_out": any(rule.conv1d for rule in mapping.rules(cfg)),
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


def _expert_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The routed experts' adapters in PEFT's layout (module docstring), by PEFT's names."""
    tensors = {}
    for name, layer in adapted(model):
        if not isinstance(layer, LoRAExperts):
            continue
        module = PREFIX + HF_EXPERTS.format(block=name.split(".")[1])
        for _, weights, nesting in EXPERT_PARAMS:
            a, b = zip(*(layer.pair(w) for w in weights), strict=True)
            a = torch.cat(a, 1).detach()  # (experts, rank, in)
            b = torch.stack([torch.block_diag(*pieces) for pieces in zip(*b, strict=True)]).detach()
            experts, out, ranks = b.shape
            tensors[f"{module}.{nesting}lora_A.weight"] = a.reshape(experts * ranks, -1).contiguous()
            tensors[f"{module}.{nesting}lora_B.weight"] = b.permute(1, 2, 0).reshape(out, -1).contiguous()
    return tensors


@torch.no_grad()
def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every adapter added into its weight (W + alpha/rank · B A), the adapters left
    out: the base model's names, as hf.to_hf and a model without adapters take them."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if not is_adapter(k)}
    for name, layer in adapted(model):
        for key, delta in layer.deltas().items():
            state[f"{name}.{key}"] += delta
    return state
