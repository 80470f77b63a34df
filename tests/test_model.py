"""The model: parameter count and FLOPs computed from the config match the real thing; causality."""

from __future__ import annotations

import pytest
import torch
from conftest import CONF_DIR
from omegaconf import OmegaConf
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from distrain.config import ModelConfig, MoEConfig
from distrain.model.families import FAMILIES
from distrain.model.llama import Transformer
from distrain.model.registry import build_model, has_plan
from distrain.model.size import _counted_parts, flops_per_token, num_params, parts

# The moe family's experts in every block, a shared one beside them (the other families ignore model.moe).
EXPERTS = MoEConfig(num_experts=4, top_k=2, expert_dim=24, shared_experts=1)
# Qwen3's attention where the family has it: heads 24 wide (not dim / n_heads), per-head norms of Q and K.
HEADS = {"plain": {}, "qwen3": {"head_dim": 24, "qk_norm": True}}
WITH_HEADS = [(t, h) for t, family in FAMILIES.items() for h in HEADS if h == "plain" or family.head_options]


def conf_models() -> list[ModelConfig]:
    return [
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(p)))
        for p in sorted((CONF_DIR / "model").glob("*.yaml"))
    ]


@pytest.mark.parametrize("cfg", conf_models(), ids=lambda c: c.name)
def test_num_params_matches_the_built_model(cfg: ModelConfig):
    with torch.device("meta"):  # the 1B model costs no memory
        model = build_model(cfg, max_seq_len=16)
    assert num_params(cfg, 16) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("target", "heads"), WITH_HEADS)
@pytest.mark.parametrize("tied", [False, True])
def test_a_family_record_matches_its_built_model(target: str, heads: str, tied: bool):
    """Every registered family's record (families/) says what the built model has: its parameter
    count, its pipeline parts, its tensor-parallel plans, its nn.Linear modules (what float8 converts, which
    `--plan` lists from the record); with and without a tied head, with
    grouped-query attention, Qwen3's heads where the family has them, and a positions' table sized by the
    run's seq_len."""
    cfg = ModelConfig(
        _target_=target, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, tie_embeddings=tied, moe=EXPERTS,
        **HEADS[heads],
    )  # fmt: skip
    with torch.device("meta"):
        model = build_model(cfg, max_seq_len=16)
    assert num_params(cfg, 16) == sum(p.numel() for p in model.parameters())
    assert parts(cfg, 16) == _counted_parts(model)
    assert has_plan(cfg, 16, "1d") == (model.tp_plan(True) is not None)
    assert has_plan(cfg, 16, "2d") == (model.grid_tp_plan() is not None)
    linears = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert FAMILIES[target].linears(cfg) == linears


@pytest.mark.parametrize(("target", "heads"), WITH_HEADS)
@pytest.mark.parametrize("kv_heads", [None, 1])
def test_flops_per_token_matches_counted_flops(target: str, heads: str, kv_heads: int | None):
    """torch's FlopCounterMode counts every matmul of forward + backward; with the math attention
    kernel that includes the attention matmuls over the whole sequence, as PaLM's formula does."""
    cfg = ModelConfig(
        _target_=target, dim=64, n_layers=3, n_heads=4, n_kv_heads=kv_heads, ffn_dim=96, moe=EXPERTS, **HEADS[heads]
    )
    seq_len, batch = 32, 2
    model = build_model(cfg, seq_len)
    tokens = torch.randint(0, 256, (batch, seq_len))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens).float().sum().backward()
    counted_per_token = counter.get_total_flops() / (batch * seq_len)
    assert flops_per_token(cfg, seq_len) == pytest.approx(counted_per_token, rel=1e-9)
    assert model.flops_per_token(seq_len) == flops_per_token(cfg, seq_len)


def test_model_sizes_are_what_their_names_say():
    sizes = {c.name: num_params(c, 16) for c in conf_models()}
    assert sizes["nano"] < 2e6 and sizes["gpt2_nano"] < 2e6
    assert 100e6 < sizes["llama_124m"] < 130e6
    assert 85e6 < sizes["gpt2_124m"] < 90e6  # GPT-2 small's 124M less 50K − 256 vocabulary rows: 85.8M
    assert 0.9e9 < sizes["llama_1b"] < 1.3e9
    assert 2e6 < sizes["moe_nano"] < 3e6 and 2e9 < sizes["moe_1b"] < 3e9  # every expert counted
    active = {c.name: flops_per_token(c, 16) for c in conf_models()}
    assert active["moe_nano"] == pytest.approx(active["nano"], rel=0.02)  # a token passes through as many weights
    gpt2 = next(c for c in conf_models() if c.name == "gpt2_nano")
    gpt2.n_positions = None  # a learned positions' table sized by the run: without its seq_len, no size
    assert num_params(gpt2, 256) == sizes["gpt2_nano"]  # 256 rows, as its n_positions said
    assert num_params(gpt2, 16) == sizes["gpt2_nano"] - 240 * gpt2.dim
    with pytest.raises(ValueError, match="model.n_positions is unset: pass the run's seq_len"):
        num_params(gpt2)


def test_attention_is_causal_and_grouped_query_attention_works():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64), 16)
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    la, lb = model(a), model(b)
    assert la.shape == (1, 16, 256)
    torch.testing.assert_close(la[0, :10], lb[0, :10])  # earlier positions never see later tokens
    assert not torch.allclose(la[0, 10:], lb[0, 10:])


def test_initial_weights_depend_on_the_seed_alone():
    """Not on torch's global generator, nor on the device the model is built on (drawn on the CPU)."""
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, ffn_dim=64)
    torch.manual_seed(1)
    a = Transformer(cfg, 8, seed=3).state_dict()
    torch.manual_seed(2)
    with torch.device("meta"):
        model = Transformer(cfg, 8, seed=3)
    model.to_empty(device="cpu").init_weights()
    b, c = model.state_dict(), Transformer(cfg, 8, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a if not k.endswith("norm.weight"))
    torch.testing.assert_close(model.rope_cos, Transformer(cfg, 8).rope_cos, rtol=0, atol=0)
