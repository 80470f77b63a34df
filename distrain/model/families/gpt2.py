"""The GPT-2 family's record (the model: distrain/model/gpt2.py): its sizes, and `GPT2LMHeadModel` as
its Hugging Face counterpart. HF's Conv1D weights are stored (in, out), with Q, K and V fused in
`c_attn`; the original checkpoints, saved from the bare `GPT2Model`, name tensors without
`transformer.`."""

from __future__ import annotations

from distrain.config import ConfigError, ModelConfig
from distrain.model.families.family import (
    Family,
    HFMapping,
    Linears,
    Rule,
    attention_weights,
    decoder_linears,
    kv_width,
    mlp_linears,
    untied_embedding,
)

ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both the tanh approximation distrain's GPT-2 uses


def matmul_weights(cfg: ModelConfig) -> int:
    return cfg.n_layers * (attention_weights(cfg) + 2 * cfg.dim * cfg.ffn_dim) + cfg.vocab_size * cfg.dim


def linears(cfg: ModelConfig) -> Linears:
    return decoder_linears(cfg, lambda c, _, at: mlp_linears(at, c.dim, c.ffn_dim, gated=False))


def other_params(cfg: ModelConfig) -> int:
    biases = 2 * cfg.dim + 2 * kv_width(cfg) + cfg.ffn_dim + cfg.dim  # wq, wo; wk, wv; w1; w2
    norms = (2 * cfg.n_layers + 1) * 2 * cfg.dim  # LayerNorm: gain and bias
    return untied_embedding(cfg) + cfg.n_layers * biases + norms


def unsupported(hf: dict) -> dict[str, tuple[bool, str]]:
    return {
        "activation_function": (hf.get("activation_function", "gelu_new") not in ACTIVATIONS, "gelu_new"),
        "scale_attn_weights": (not hf.get("scale_attn_weights", True), "true"),
        "scale_attn_by_inverse_layer_idx": (hf.get("scale_attn_by_inverse_layer_idx", False), "false"),
        "add_cross_attention": (hf.get("add_cross_attention", False), "false"),
    }


def shape(hf: dict) -> dict:
    dim = hf["n_embd"]
    return {
        "dim": dim,
        "n_layers": hf["n_layer"],
        "n_heads": hf["n_head"],
        "n_kv_heads": None,
        "head_dim": None,
        "qk_norm": False,
        "ffn_dim": hf.get("n_inner") or 4 * dim,
        "vocab_size": hf["vocab_size"],
        "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        "tie_embeddings": hf.get("tie_word_embeddings", True),
        "n_positions": hf["n_positions"],
    }


def config(cfg: ModelConfig, max_seq_len: int) -> dict:
    if (cfg.n_kv_heads or cfg.n_heads) != cfg.n_heads:
        raise ConfigError(f"model.n_kv_heads={cfg.n_kv_heads}: Hugging Face's GPT-2 has no grouped-query attention")
    return {
        "model_type": "gpt2",
        "n_embd": cfg.dim,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.ffn_dim,
        "n_positions": cfg.n_positions or max_seq_len,
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": "gelu_new",
    }


def rules(cfg: ModelConfig) -> list[Rule]:
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


FAMILY = Family(
    target="distrain.model.gpt2.GPT2",
    matmul_weights=matmul_weights,
    other_params=other_params,
    learned_positions=True,
    rotary=False,
    tp=True,
    grid_tp=False,
    linears=linears,
    hf=(HFMapping("GPT2LMHeadModel", unsupported, shape, config, rules, bare_prefix="transformer."),),
)
