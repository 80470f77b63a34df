"""The moe family's record (the model: distrain/model/moe.py): the Llama decoder's sizes with experts in the
blocks model.moe chooses. Its parameters count every expert; its FLOPs count the weights a token passes
through (`active_weights`): the router, its top_k experts and the shared ones, as DeepSeek and torchtitan
count a sparse model's MFU. Its Hugging Face counterparts: Mixtral (`MixtralForCausalLM`): Llama's attention, and
in every block a softmax router choosing top_k experts, their weights renormalised, no shared expert, none dropped;
and with model.qk_norm Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (llama.py's record), the same router
renormalising or not (`norm_topk_prob`: model.moe.normalize), experts `moe_intermediate_size` wide in every
`decoder_sparse_step`-th block but `mlp_only_layers`, the others an MLP `intermediate_size` wide. Both hold a
tensor per expert where distrain stacks them (`Rule.expert`)."""

from __future__ import annotations

from distrain.config import ConfigError, ModelConfig, MoEConfig
from distrain.model.families import llama
from distrain.model.families.family import (
    Family,
    HFMapping,
    Linears,
    Rule,
    attention_weights,
    decoder_linears,
    mlp_linears,
)


def _weights(cfg: ModelConfig, experts_per_token: int | None) -> int:
    """Matmul weights of the whole model, or (`experts_per_token`) those one token passes through."""
    m, mlp = cfg.moe, 3 * cfg.dim
    hidden = m.expert_dim or cfg.ffn_dim
    total = cfg.vocab_size * cfg.dim
    for block in range(cfg.n_layers):
        total += attention_weights(cfg)
        if m.is_sparse(block):
            experts = m.num_experts if experts_per_token is None else experts_per_token
            total += cfg.dim * m.num_experts + mlp * hidden * (experts + m.shared_experts)
        else:
            total += mlp * cfg.ffn_dim
    return total


def matmul_weights(cfg: ModelConfig) -> int:
    return _weights(cfg, None)


def linears(cfg: ModelConfig) -> Linears:
    """Llama's, but a sparse block's feed-forward: its router and its shared experts (the routed experts are no
    nn.Linear: one stacked weight each)."""
    return decoder_linears(cfg, _feed_forward)


def _feed_forward(cfg: ModelConfig, block: int, at: str) -> Linears:
    m = cfg.moe
    if not m.is_sparse(block):
        return mlp_linears(at, cfg.dim, cfg.ffn_dim, gated=True)
    shared = mlp_linears(f"{at}.shared", cfg.dim, (m.expert_dim or cfg.ffn_dim) * m.shared_experts, gated=True)
    return {f"{at}.router": (cfg.dim, m.num_experts)} | (shared if m.shared_experts else {})


def routed_experts(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    m = cfg.moe
    sparse = (b for b in range(cfg.n_layers) if m.is_sparse(b))
    return {f"layers.{b}.feed_forward.experts": (m.num_experts, cfg.dim, m.expert_dim or cfg.ffn_dim) for b in sparse}


def active_weights(cfg: ModelConfig) -> int:
    return _weights(cfg, cfg.moe.top_k)


SCORES, BALANCES = ("softmax", "sigmoid"), ("aux_loss", "bias", "none")


def check(cfg: ModelConfig) -> None:
    """model.moe's rules, each a one-line ConfigError naming the key and the fix."""
    m = cfg.moe
    rules = (
        (m.num_experts >= 1, f"model.moe.num_experts={m.num_experts}: the moe family needs at least 1 expert"),
        (1 <= m.top_k <= m.num_experts, f"model.moe.top_k={m.top_k}: must be 1 to num_experts={m.num_experts}"),
        (m.score in SCORES, f"model.moe.score={m.score}: must be one of {', '.join(SCORES)}"),
        (m.balance in BALANCES, f"model.moe.balance={m.balance}: must be one of {', '.join(BALANCES)}"),
        (m.expert_dim is None or m.expert_dim >= 1, f"model.moe.expert_dim={m.expert_dim}: must be ≥ 1 (or null)"),
        (m.every >= 1, f"model.moe.every={m.every}: must be ≥ 1"),
        (m.first_dense >= 0 and m.shared_experts >= 0, "model.moe.first_dense and shared_experts must be ≥ 0"),
        (min(m.aux_loss_weight, m.z_loss_weight, m.bias_rate, m.capacity_factor) >= 0,
         "model.moe.aux_loss_weight, z_loss_weight, bias_rate and capacity_factor must be ≥ 0"),
        (m.every < 1 or any(m.is_sparse(b) for b in range(cfg.n_layers)),
         f"model.moe: no block of {cfg.n_layers} has experts (first_dense={m.first_dense}, every={m.every})"),
    )  # fmt: skip
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)


def unsupported(hf: dict) -> dict[str, tuple[bool, str]]:
    return llama.unsupported(hf) | {"sliding_window": (hf.get("sliding_window") is not None, "null")}


def shape(hf: dict) -> dict:
    experts = {"num_experts": hf["num_local_experts"], "top_k": hf["num_experts_per_tok"], "expert_dim": None}
    experts |= {"shared_experts": 0, "every": 1, "first_dense": 0, "score": "softmax", "normalize": True}
    experts |= {"capacity_factor": 0.0, "aux_loss_weight": hf.get("router_aux_loss_coef", 0.001)}
    return llama.shape(hf) | {"moe": experts}


def _refuse_differences(m: MoEConfig, name: str, *more: tuple[bool, str]) -> None:
    """A ConfigError for the first model.moe setting the Hugging Face model `name` computes otherwise: the
    settings neither Mixtral nor Qwen3-MoE has, then `more` (ok, message)."""
    differs = (
        (m.score == "softmax", f"model.moe.score={m.score}: {name}'s router is a softmax"),
        (m.shared_experts == 0, f"model.moe.shared_experts={m.shared_experts}: {name} has no shared expert"),
        (m.balance != "bias", f"model.moe.balance=bias: {name}'s router has no per-expert bias on its choice"),
        (m.capacity_factor == 0, f"model.moe.capacity_factor={m.capacity_factor}: {name} drops no token"),
        *more,
    )  # fmt: skip
    for ok, message in differs:
        if not ok:
            raise ConfigError(message)


def config(cfg: ModelConfig, max_seq_len: int) -> dict:
    """Mixtral's config.json; a ConfigError for each model.moe setting Mixtral computes otherwise."""
    m = cfg.moe
    _refuse_differences(
        m,
        "Mixtral",
        (m.normalize, "model.moe.normalize=false: Mixtral renormalises the chosen experts' weights"),
        (m.every == 1 and m.first_dense == 0,
         f"model.moe.every={m.every}, first_dense={m.first_dense}: Mixtral has experts in every block (1 and 0)"),
    )  # fmt: skip
    hf = llama.config(cfg, max_seq_len) | {"model_type": "mixtral", "intermediate_size": m.expert_dim or cfg.ffn_dim}
    experts = {"num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k}
    experts |= {"router_aux_loss_coef": m.aux_loss_weight, "router_jitter_noise": 0.0, "sliding_window": None}
    return hf | experts


def _rules(cfg: ModelConfig, layer: str, matrices: tuple[str, str, str]) -> list[Rule]:
    """Llama's (and with model.qk_norm Qwen3's), less the MLPs of the blocks with experts; in each of those the
    router (`{layer}.gate`) and each expert's w1, w2, w3, named `matrices` in the HF files."""
    sparse = [i for i in range(cfg.n_layers) if cfg.moe.is_sparse(i)]
    mlps = tuple(f"model.layers.{i}.mlp." for i in sparse)
    out = [rule for rule in llama.rules(cfg) if not rule.hf.startswith(mlps)]
    for i in sparse:
        hf, d = f"model.layers.{i}.{layer}", f"layers.{i}.feed_forward"
        out.append(Rule(f"{hf}.gate.weight", (f"{d}.router.weight",)))
        for e in range(cfg.moe.num_experts):
            out += [
                Rule(f"{hf}.experts.{e}.{name}.weight", (f"{d}.experts.{w}",), expert=e)
                for w, name in zip(("w1", "w2", "w3"), matrices, strict=True)
            ]
    return out


def rules(cfg: ModelConfig) -> list[Rule]:
    return _rules(cfg, "block_sparse_moe", ("w1", "w2", "w3"))


def first_dense(hf: dict) -> int | None:
    """model.moe.first_dense for Qwen3-MoE's blocks with experts (every decoder_sparse_step-th, but those in
    mlp_only_layers): one past the last such block mlp_only_layers keeps dense, where it keeps every such block
    before it dense too; None where no first_dense says it (a block with experts before a dense one)."""
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    chosen = [i for i in range(hf["num_hidden_layers"]) if (i + 1) % step == 0]
    first = max((i + 1 for i in chosen if i in dense), default=0)
    return first if all(i in dense for i in chosen if i < first) else None


def qwen3_unsupported(hf: dict) -> dict[str, tuple[bool, str]]:
    wanted = "blocks before the first with experts only (model.moe.first_dense)"
    return llama.qwen3_unsupported(hf) | {"mlp_only_layers": (first_dense(hf) is None, wanted)}


def qwen3_shape(hf: dict) -> dict:
    experts = {"num_experts": hf.get("num_experts", hf.get("num_local_experts")), "top_k": hf["num_experts_per_tok"]}
    experts |= {"expert_dim": hf["moe_intermediate_size"], "shared_experts": 0, "score": "softmax"}
    experts |= {"every": hf.get("decoder_sparse_step", 1), "first_dense": first_dense(hf)}
    experts |= {"normalize": hf.get("norm_topk_prob", False), "capacity_factor": 0.0}
    experts |= {"aux_loss_weight": hf.get("router_aux_loss_coef", 0.001)}
    return llama.qwen3_shape(hf) | {"moe": experts}


def qwen3_config(cfg: ModelConfig, max_seq_len: int) -> dict:
    """Qwen3-MoE's config.json; a ConfigError for each model.moe setting it computes otherwise."""
    m = cfg.moe
    _refuse_differences(m, "Qwen3-MoE")
    hf = llama.qwen3_config(cfg, max_seq_len) | {"model_type": "qwen3_moe", "intermediate_size": cfg.ffn_dim}
    experts = {"num_experts": m.num_experts, "num_experts_per_tok": m.top_k}
    experts |= {"moe_intermediate_size": m.expert_dim or cfg.ffn_dim, "norm_topk_prob": m.normalize}
    experts |= {"decoder_sparse_step": m.every, "mlp_only_layers": list(range(m.first_dense))}
    experts |= {"router_aux_loss_coef": m.aux_loss_weight}
    return hf | experts


def qwen3_rules(cfg: ModelConfig) -> list[Rule]:
    return _rules(cfg, "mlp", ("gate_proj", "down_proj", "up_proj"))


FAMILY = Family(
    target="distrain.model.moe.MoETransformer",
    matmul_weights=matmul_weights,
    other_params=llama.other_params,
    learned_positions=False,
    rotary=True,
    tp=True,
    grid_tp=False,
    linears=linears,
    active_weights=active_weights,
    check=check,
    routed_experts=routed_experts,
    hf=(
        HFMapping("MixtralForCausalLM", unsupported, shape, config, rules),
        HFMapping("Qwen3MoeForCausalLM", qwen3_unsupported, qwen3_shape, qwen3_config, qwen3_rules, qk_norm=True),
    ),
    head_options=True,
)
