"""Hugging Face interop: a `config.json` ↔ a distrain `ModelConfig`, and HF tensor names ↔ distrain's.

Two families: `LlamaForCausalLM` (distrain.model.llama.Transformer) and `GPT2LMHeadModel`
(distrain.model.gpt2.GPT2). Anything the distrain model would compute differently (rope scaling,
biases, another activation, ...) is refused with a one-line ConfigError rather than loaded wrong.

One table of `Rule`s per family says where each distrain parameter lives in the HF file, and serves
both directions: `hf_weights` reads one tensor at a time (safetensors' `safe_open`, sharded files
included) for `contract.fill_parameters`, so every layout loads only what it keeps; `to_hf` turns a
whole state dict into HF's. Two layouts differ beyond names: GPT-2's Conv1D weights are stored (in, out)
with Q, K and V fused in `c_attn`; and HF's Llama rotates the two halves of each head (`rotate_half`)
where distrain rotates consecutive pairs, so Q's and K's rows are permuted per head.

The driver imports this module (`resolve_init_from`): torch is imported only where tensors are read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from distrain.config import ConfigError, ModelConfig, TrainConfig

if TYPE_CHECKING:
    import torch

LLAMA, GPT2 = "distrain.model.llama.Transformer", "distrain.model.gpt2.GPT2"
ARCHITECTURES = {"LlamaForCausalLM": LLAMA, "GPT2LMHeadModel": GPT2}
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both the tanh approximation distrain's GPT-2 uses
INDEX_FILE, WEIGHTS_FILE = "model.safetensors.index.json", "model.safetensors"


@dataclasses.dataclass(frozen=True)
class Rule:
    """HF tensor `hf` holds distrain's `names`, concatenated along rows (GPT-2's fused Q, K, V);
    `conv1d`: stored transposed (in, out); `heads`: rows permuted per head (Llama's Q and K)."""

    hf: str
    names: tuple[str, ...]
    conv1d: bool = False
    heads: int | None = None


def _refuse(directory: str | Path, what: str, fix: str) -> None:
    raise ConfigError(f"model.init_from={directory}: {what}; {fix}")


def model_config(directory: str | Path, base: ModelConfig) -> ModelConfig:
    """The distrain model a Hugging Face config.json describes (`base` keeps what HF does not say:
    init_std); a ConfigError for an architecture or option distrain's model would compute differently."""
    try:
        hf = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError) as e:
        _refuse(directory, f"no readable config.json ({type(e).__name__})", "give a Hugging Face model directory")
    arch = (hf.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        _refuse(directory, f"architecture {arch!r} is not supported", f"use one of {', '.join(ARCHITECTURES)}")
    try:
        shape = _llama_shape(directory, hf) if arch == "LlamaForCausalLM" else _gpt2_shape(directory, hf)
    except KeyError as e:
        _refuse(directory, f"its config.json has no {e}", f"save it with transformers' {arch}")
    return dataclasses.replace(
        base, _target_=ARCHITECTURES[arch], name=Path(directory).name, init_from=os.path.abspath(directory), **shape
    )


def _llama_shape(directory: str | Path, hf: dict) -> dict:
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
    unsupported = {
        "hidden_act": (hf.get("hidden_act", "silu") != "silu", "silu"),
        "rope_scaling": (bool(hf.get("rope_scaling")), "null"),
        "rope_parameters": (rope.get("rope_type", "default") != "default", "rope_type default"),
        "attention_bias": (hf.get("attention_bias", False), "false"),
        "mlp_bias": (hf.get("mlp_bias", False), "false"),
        "head_dim": (hf.get("head_dim", dim // heads) != dim // heads, "hidden_size / num_attention_heads"),
        "pretraining_tp": (hf.get("pretraining_tp", 1) != 1, "1"),
    }
    _check_options(directory, hf, unsupported)
    return {
        "dim": dim,
        "n_layers": hf["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "ffn_dim": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "tie_embeddings": hf.get("tie_word_embeddings", False),
        "n_positions": None,
    }


def _gpt2_shape(directory: str | Path, hf: dict) -> dict:
    unsupported = {
        "activation_function": (hf.get("activation_function", "gelu_new") not in GPT2_ACTIVATIONS, "gelu_new"),
        "scale_attn_weights": (not hf.get("scale_attn_weights", True), "true"),
        "scale_attn_by_inverse_layer_idx": (hf.get("scale_attn_by_inverse_layer_idx", False), "false"),
        "add_cross_attention": (hf.get("add_cross_attention", False), "false"),
    }
    _check_options(directory, hf, unsupported)
    dim = hf["n_embd"]
    return {
        "dim": dim,
        "n_layers": hf["n_layer"],
        "n_heads": hf["n_head"],
        "n_kv_heads": None,
        "ffn_dim": hf.get("n_inner") or 4 * dim,
        "vocab_size": hf["vocab_size"],
        "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        "tie_embeddings": hf.get("tie_word_embeddings", True),
        "n_positions": hf["n_positions"],
    }


def _check_options(directory: str | Path, hf: dict, unsupported: dict[str, tuple[bool, str]]) -> None:
    for key, (bad, wanted) in unsupported.items():  # (set to what distrain cannot compute, what it must be)
        if bad:
            _refuse(directory, f"{key}={hf.get(key)!r} is not supported by distrain's model", f"it must be {wanted}")


def resolve_init_from(cfg: TrainConfig, say: Callable[[str], None] = print) -> TrainConfig:
    """In the driver, before validation: with model.init_from, the model's family, shape and vocabulary
    come from the directory's config.json (said in one line); its weights are checked to be there. The
    path is made absolute: the workers read it (on a cluster, from storage every node shares)."""
    directory = cfg.model.init_from
    if not directory:
        return cfg
    model = model_config(directory, cfg.model)
    if not (Path(directory) / INDEX_FILE).is_file() and not (Path(directory) / WEIGHTS_FILE).is_file():
        _refuse(directory, f"neither {WEIGHTS_FILE} nor {INDEX_FILE}", "save the model with safetensors")
    keys = ("_target_", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings")
    settings = " ".join(f"model.{k}={getattr(model, k)}" for k in keys)
    say(f"distrain: model.init_from={directory}: {settings} (from its config.json; its weights load once laid out)")
    return dataclasses.replace(cfg, model=model)


def rules(cfg: ModelConfig) -> list[Rule]:
    """Where each distrain parameter lives in the HF file of cfg's family."""
    if cfg._target_ not in (LLAMA, GPT2):
        raise ConfigError(f"model._target_={cfg._target_} has no Hugging Face counterpart: only {LLAMA} and {GPT2}")
    return _llama_rules(cfg) if cfg._target_ == LLAMA else _gpt2_rules(cfg)


def _llama_rules(cfg: ModelConfig) -> list[Rule]:
    out = [Rule("model.embed_tokens.weight", ("tok_embeddings.weight",)), Rule("model.norm.weight", ("norm.weight",))]
    if not cfg.tie_embeddings:
        out.append(Rule("lm_head.weight", ("output.weight",)))
    kv = cfg.n_kv_heads or cfg.n_heads
    for i in range(cfg.n_layers):
        hf, d = f"model.layers.{i}", f"layers.{i}"
        out += [
            Rule(f"{hf}.input_layernorm.weight", (f"{d}.attention_norm.weight",)),
            Rule(f"{hf}.self_attn.q_proj.weight", (f"{d}.attention.wq.weight",), heads=cfg.n_heads),
            Rule(f"{hf}.self_attn.k_proj.weight", (f"{d}.attention.wk.weight",), heads=kv),
            Rule(f"{hf}.self_attn.v_proj.weight", (f"{d}.attention.wv.weight",)),
            Rule(f"{hf}.self_attn.o_proj.weight", (f"{d}.attention.wo.weight",)),
            Rule(f"{hf}.post_attention_layernorm.weight", (f"{d}.ffn_norm.weight",)),
            Rule(f"{hf}.mlp.gate_proj.weight", (f"{d}.feed_forward.w1.weight",)),
            Rule(f"{hf}.mlp.up_proj.weight", (f"{d}.feed_forward.w3.weight",)),
            Rule(f"{hf}.mlp.down_proj.weight", (f"{d}.feed_forward.w2.weight",)),
        ]
    return out


def _gpt2_rules(cfg: ModelConfig) -> list[Rule]:
    both = ("weight", "bias")
    out = [
        Rule("transformer.wte.weight", ("tok_embeddings.weight",)),
        Rule("transformer.wpe.weight", ("pos_embeddings.weight",)),
        *(Rule(f"transformer.ln_f.{p}", (f"norm.{p}",)) for p in both),
    ]
    if not cfg.tie_embeddings:
        out.append(Rule("lm_head.weight", ("output.weight",)))
    for i in range(cfg.n_layers):
        hf, d = f"transformer.h.{i}", f"layers.{i}"
        for p in both:
            out += [
                Rule(f"{hf}.ln_1.{p}", (f"{d}.attention_norm.{p}",)),
                Rule(f"{hf}.attn.c_attn.{p}", tuple(f"{d}.attention.{w}.{p}" for w in ("wq", "wk", "wv")), True),
                Rule(f"{hf}.attn.c_proj.{p}", (f"{d}.attention.wo.{p}",), True),
                Rule(f"{hf}.ln_2.{p}", (f"{d}.ffn_norm.{p}",)),
                Rule(f"{hf}.mlp.c_fc.{p}", (f"{d}.feed_forward.w1.{p}",), True),
                Rule(f"{hf}.mlp.c_proj.{p}", (f"{d}.feed_forward.w2.{p}",), True),
            ]
    return out


def _rope_rows(t: torch.Tensor, heads: int, to_hf: bool) -> torch.Tensor:
    """Per head, HF's row order (first half, second half) ↔ distrain's (pairs (j, j + head_dim/2) adjacent)."""
    grouped = t.unflatten(0, (heads, 2, -1) if not to_hf else (heads, -1, 2))
    return grouped.transpose(1, 2).flatten(0, 2)


def _to_distrain(rule: Rule, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if rule.conv1d and t.dim() == 2:
        t = t.t()
    if rule.heads:
        t = _rope_rows(t, rule.heads, to_hf=False)
    return t.chunk(len(rule.names)) if len(rule.names) > 1 else (t,)


def _to_hf(rule: Rule, parts: list[torch.Tensor]) -> torch.Tensor:
    import torch

    t = torch.cat(parts) if len(parts) > 1 else parts[0]
    if rule.heads:
        t = _rope_rows(t, rule.heads, to_hf=True)
    return (t.t() if rule.conv1d and t.dim() == 2 else t).contiguous()


class _Files:
    """The directory's safetensors, one tensor read at a time; GPT-2 files saved from the bare `GPT2Model`
    (as the original checkpoints are) name tensors without the `transformer.` prefix."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        if (d / INDEX_FILE).is_file():
            self.where = {k: d / f for k, f in json.loads((d / INDEX_FILE).read_text())["weight_map"].items()}
        else:
            from safetensors import safe_open

            with safe_open(str(d / WEIGHTS_FILE), "pt") as f:
                self.where = {k: d / WEIGHTS_FILE for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        self.directory = directory

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        stored = name if name in self.where else name.removeprefix("transformer.")
        if stored not in self.where:
            _refuse(self.directory, f"its weights have no tensor {name!r}", "export the whole model")
        with safe_open(str(self.where[stored]), "pt") as f:
            return f.get_tensor(stored)


def hf_weights(directory: str | Path, cfg: ModelConfig) -> Callable[[str, torch.Size], torch.Tensor]:
    """`value_of(name, shape)` for contract.fill_parameters: distrain parameter `name`'s full value read
    from the HF directory (only the tensor holding it), as float32."""
    files, by_name = _Files(directory), {}
    for rule in rules(cfg):
        for index, name in enumerate(rule.names):
            by_name[name] = (rule, index)
    if cfg.tie_embeddings:
        by_name["output.weight"] = by_name["tok_embeddings.weight"]

    def value_of(name: str, shape: torch.Size) -> torch.Tensor:
        if name not in by_name:
            _refuse(directory, f"distrain parameter {name!r} has no Hugging Face counterpart", "check model._target_")
        rule, index = by_name[name]
        value = _to_distrain(rule, files.get(rule.hf).float())[index]
        if value.shape != shape:
            _refuse(directory, f"{rule.hf} gives {name} shape {tuple(value.shape)}, not {tuple(shape)}", "re-save it")
        return value

    return value_of


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A whole distrain state dict (full tensors) as the HF model's tensors (a tied head left out, as
    `save_pretrained` does)."""
    return {rule.hf: _to_hf(rule, [state[n] for n in rule.names]) for rule in rules(cfg)}


def hf_config(cfg: ModelConfig, max_seq_len: int) -> dict:
    """The config.json of cfg's HF counterpart (float32 weights), trained on sequences of max_seq_len."""
    rules(cfg)  # refuses a family HF does not have
    if cfg._target_ == GPT2 and (cfg.n_kv_heads or cfg.n_heads) != cfg.n_heads:
        raise ConfigError(f"model.n_kv_heads={cfg.n_kv_heads}: Hugging Face's GPT-2 has no grouped-query attention")
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32"}
    if cfg._target_ == LLAMA:
        return common | {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": cfg.dim,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
            "intermediate_size": cfg.ffn_dim,
            "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "hidden_act": "silu",
            "head_dim": cfg.dim // cfg.n_heads,
            "max_position_embeddings": max_seq_len,
        }
    return common | {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": cfg.dim,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.ffn_dim,
        "n_positions": cfg.n_positions or max_seq_len,
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": "gelu_new",
    }
