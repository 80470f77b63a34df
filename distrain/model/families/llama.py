"""The Llama family's record (the model: distrain/model/llama.py): its sizes, and two Hugging Face counterparts,
`LlamaForCausalLM` and, with model.qk_norm, Qwen3's `Qwen3ForCausalLM` (Llama's decoder whose attention RMS-norms
each head's Q and K before the rotation, `q_norm` and `k_norm`). HF rotates the two halves of each head
(`rotate_half`) where distrain rotates consecutive pairs, so Q's and K's rows are permuted per head, and the
per-head gains within the head (`Rule.heads`)."""

from __future__ import annotations

from distrain.config import ModelConfig
from distrain.model.families.family import (
    Family,
    HFMapping,
    Linears,
    Rule,
    attention_weights,
    decoder_linears,
    mlp_linears,
    qk_norm_gains,
    untied_embedding,
)


def matmul_weights(cfg: ModelConfig) -> int:
    return cfg.n_layers * (attention_weights(cfg) + 3 * cfg.dim * cfg.ffn_dim) + cfg.vocab_size * cfg.dim


def linears(cfg: ModelConfig) -> Linears:
    return decoder_linears(cfg, lambda c, _, at: mlp_linears(at, c.dim, c.ffn_dim, gated=True))


def other_params(cfg: ModelConfig) -> int:
    """The RMSNorms' gains: two a block and the final one over dim, and with model.qk_norm two over a head."""
    return untied_embedding(cfg) + (2 * cfg.n_layers + 1) * cfg.dim + cfg.n_layers * qk_norm_gains(cfg)


def unsupported(hf: dict) -> dict[str, tuple[bool, str]]:
    rope = _rope(hf)
    return {
        "hidden_act": (hf.get("hidden_act", "silu") != "silu", "silu"),
        "rope_scaling": (bool(hf.get("rope_scaling")), "null"),
        "rope_parameters": (rope.get("rope_type", "default") != "default", "rope_type default"),
        "attention_bias": (hf.get("attention_bias", False), "false"),
        "mlp_bias": (hf.get("mlp_bias", False), "false"),
        "pretraining_tp": (hf.get("pretraining_tp", 1) != 1, "1"),
    }


def _rope(hf: dict) -> dict:
    return hf.get("rope_parameters") or {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}


def shape(hf: dict) -> dict:
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // heads
    return {
        "dim": dim,
        "n_layers": hf["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": None if head_dim * heads == dim else head_dim,  # None where dim / n_heads gives it
        "qk_norm": False,
        "ffn_dim": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": float(_rope(hf).get("rope_theta", 10000.0)),
        "tie_embeddings": hf.get("tie_word_embeddings", False),
        "n_positions": None,
    }


def config(cfg: ModelConfig, max_seq_len: int) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
        "intermediate_size": cfg.ffn_dim,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "hidden_act": "silu",
        "head_dim": cfg.head_width(),
        "max_position_embeddings": max_seq_len,
    }


def rules(cfg: ModelConfig) -> list[Rule]:
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
        if cfg.qk_norm:  # a gain per place in the head, permuted within it as Q's and K's rows are
            out += [Rule(f"{hf}.self_attn.{n}.weight", (f"{d}.attention.{n}.weight",), heads=1) for n in QK_NORMS]
    return out


QK_NORMS = ("q_norm", "k_norm")  # the per-head norms' names, the same in distrain and HF


def qwen3_unsupported(hf: dict) -> dict[str, tuple[bool, str]]:
    """Llama's, and Qwen3's sliding window (distrain's attention sees the whole causal context)."""
    windows = [t for t in hf.get("layer_types") or () if t != "full_attention"]
    return unsupported(hf) | {
        "use_sliding_window": (hf.get("use_sliding_window", False), "false"),
        "layer_types": (bool(windows), "full_attention in every block"),
    }


def qwen3_shape(hf: dict) -> dict:
    return shape(hf) | {"qk_norm": True}


def qwen3_config(cfg: ModelConfig, max_seq_len: int) -> dict:
    return config(cfg, max_seq_len) | {"model_type": "qwen3", "use_sliding_window": False, "sliding_window": None}


LLAMA = HFMapping("LlamaForCausalLM", unsupported, shape, config, rules)
QWEN3 = HFMapping("Qwen3ForCausalLM", qwen3_unsupported, qwen3_shape, qwen3_config, rules, qk_norm=True)

FAMILY = Family(
    target="distrain.model.llama.Transformer",
    matmul_weights=matmul_weights,
    other_params=other_params,
    learned_positions=False,
    rotary=True,
    tp=True,
    grid_tp=True,
    linears=linears,
    hf=(LLAMA, QWEN3),
    head_options=True,
)
