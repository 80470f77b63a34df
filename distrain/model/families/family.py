"""What distrain knows of a shipped model family without building it: the record the driver reads
(sizes, FLOPs, which tensor-parallel plans exist) and the Hugging Face mapping export and import read.
Torch-free: the driver plans and validates without importing torch.

FLOPs are counted as PaLM does (Chowdhery et al. 2022, appendix B): 6·N + 12·L·H·Q·T, N the weights
that multiply the token (every matrix but the embedding lookups; the head counts even when tied), L
layers, H heads of Q dimensions (model.head_dim, else dim / H), T the sequence length. The attention term
counts the scores and their weighted sum over the whole sequence, as PaLM and Megatron do, so MFU compares
with theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from distrain.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    """HF tensor `hf` holds distrain's `names`, concatenated along rows (GPT-2's fused Q, K, V);
    `conv1d`: stored transposed (in, out); `heads`: rows permuted per head (Llama's Q and K); `expert`: it is
    one expert's slice of distrain's stacked experts (`names[0][expert]`: Mixtral's tensor per expert). `heads=1`
    permutes a per-head gain (Qwen3's q_norm, k_norm) as Q's rows are permuted within each head."""

    hf: str
    names: tuple[str, ...]
    conv1d: bool = False
    heads: int | None = None
    expert: int | None = None


@dataclass(frozen=True)
class HFMapping:
    """A family's Hugging Face counterpart, both ways (model/hf.py applies it).

    `unsupported(config.json)`: each option distrain's model would compute differently, as
    {key: (set to what distrain cannot compute, what it must be)}; `shape(config.json)`: the ModelConfig
    fields it describes (a KeyError for a key it lacks); `config(cfg, max_seq_len)`: the config.json
    of cfg's counterpart, less what every family shares (a ConfigError where HF has no such model);
    `rules(cfg)`: where each distrain parameter lives in the HF files; `bare_prefix`: a prefix the
    files of the bare base model (no head) leave out of every name; `qk_norm`: the counterpart norms each
    head's Q and K (Qwen3), and export takes the family's mapping whose `qk_norm` is model.qk_norm."""

    architecture: str
    unsupported: Callable[[dict], dict[str, tuple[bool, str]]]
    shape: Callable[[dict], dict]
    config: Callable[[ModelConfig, int], dict]
    rules: Callable[[ModelConfig], list[Rule]]
    bare_prefix: str = ""
    qk_norm: bool = False


Linears = dict[str, tuple[int, int]]
OUTPUT_MODULES = ("norm", "output")  # every family's modules after the blocks (common.FamilyModel's)


@dataclass(frozen=True)
class Family:
    """A shipped family: `target` builds it (model._target_, imported only when a model is built).
    Its parameters are `matmul_weights` (those multiplying a token, the head included even when tied)
    plus `other_params` (embeddings not counted there, norms, biases) plus, with `learned_positions`,
    a positions' table of model.n_positions (else the run's seq_len) rows. `rotary`: the head
    dimension must be even. `tp` / `grid_tp`: the model has a plan for 1-D / for 2-D, 2.5-D and 3-D
    tensor parallelism (the latter neither with a tied head nor with model.qk_norm). `hf`: its Hugging Face
    counterparts, none or several (told apart by `HFMapping.qk_norm`). `head_options`: the model honours
    model.head_dim and model.qk_norm (else the driver refuses them)."""

    target: str
    matmul_weights: Callable[[ModelConfig], int]
    other_params: Callable[[ModelConfig], int]
    learned_positions: bool
    rotary: bool
    tp: bool
    grid_tp: bool
    # Every nn.Linear's (in, out) features by full-model name: what float8 training converts (strategy/float8.py).
    linears: Callable[[ModelConfig], Linears]
    hf: tuple[HFMapping, ...] = ()
    head_options: bool = False
    # A sparse model's matmul weights one token passes through (its FLOPs count these); None: all of them.
    active_weights: Callable[[ModelConfig], int] | None = None
    # Rules on the family's own settings (model.moe), one-line ConfigErrors; None: it has none.
    check: Callable[[ModelConfig], None] | None = None
    # Each block's routed experts (model/moe.py's Experts) by full-model name: (experts, dim, hidden); None: none.
    routed_experts: Callable[[ModelConfig], dict[str, tuple[int, int, int]]] | None = None

    def flops_per_token(self, cfg: ModelConfig, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at sequence length `seq_len` (module docstring)."""
        return decoder_flops((self.active_weights or self.matmul_weights)(cfg), cfg, seq_len)


def decoder_flops(matmul_weights: int, cfg: ModelConfig, seq_len: int) -> float:
    """6·N + 12·L·H·Q·T: a model of the usual decoder shape may compute its own with this."""
    return 6 * matmul_weights + 12 * cfg.n_layers * cfg.n_heads * cfg.head_width() * seq_len


def attention_weights(cfg: ModelConfig) -> int:
    """wq, wo (dim × the heads' width) and wk, wv (dim × the key/value heads' width) of one block."""
    return cfg.dim * cfg.n_heads * cfg.head_width() * 2 + cfg.dim * kv_width(cfg) * 2


def attention_linears(cfg: ModelConfig, block: str) -> Linears:
    """A block's wq, wk, wv (the residual stream to the heads' and the key/value heads' widths) and wo."""
    heads, at = cfg.n_heads * cfg.head_width(), f"{block}.attention"
    return {
        f"{at}.wq": (cfg.dim, heads),
        f"{at}.wk": (cfg.dim, kv_width(cfg)),
        f"{at}.wv": (cfg.dim, kv_width(cfg)),
        f"{at}.wo": (heads, cfg.dim),
    }


def mlp_linears(at: str, dim: int, hidden: int, gated: bool) -> Linears:
    """An MLP's w1 (and with `gated` w3) from dim to hidden, and w2 back."""
    up = {f"{at}.w1": (dim, hidden), f"{at}.w2": (hidden, dim)}
    return up | {f"{at}.w3": (dim, hidden)} if gated else up


def decoder_linears(cfg: ModelConfig, feed_forward: Callable[[ModelConfig, int, str], Linears]) -> Linears:
    """Every block's attention and `feed_forward(cfg, block, its name)`, then the head."""
    found: Linears = {}
    for block in range(cfg.n_layers):
        found |= attention_linears(cfg, f"layers.{block}") | feed_forward(cfg, block, f"layers.{block}.feed_forward")
    return found | {"output": (cfg.dim, cfg.vocab_size)}


def kv_width(cfg: ModelConfig) -> int:
    return (cfg.n_kv_heads or cfg.n_heads) * cfg.head_width()


def qk_norm_gains(cfg: ModelConfig) -> int:
    """One block's per-head gains of Q and K (model.qk_norm), one head wide each."""
    return 2 * cfg.head_width() if cfg.qk_norm else 0


def untied_embedding(cfg: ModelConfig) -> int:
    """The token embedding's table where it is not the head's weight (that one counts as a matmul)."""
    return 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
