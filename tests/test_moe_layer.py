"""The moe family's layer (distrain/model/moe.py) on its own, without Ray: against a token-by-token reference that
shares none of its dispatch; its capacity, its balancing (the auxiliary loss's gradient and the loss-free bias),
its figures under recomputation, its size record and its refusals. Tolerance 1e-5, absolute and relative (fp32,
sums in another order). Its training under every layout: tests/test_moe.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import make_config

from distrain.config import ConfigError, ModelConfig, MoEConfig, StrategyConfig
from distrain.driver.validation import validate
from distrain.model.moe import MoE, aux_loss_scale, moe_layers, route
from distrain.model.registry import build_model
from distrain.model.size import flops_per_token, num_params
from distrain.parallel.parallelize import apply_activation_checkpointing

NANO = dict(_target_="distrain.model.moe.MoETransformer", name="moe", dim=32, n_layers=2, n_heads=2, ffn_dim=48)


def layer(seed: int = 0, **moe) -> MoE:
    """One MoE layer of 8 experts, its weights drawn from `seed`."""
    cfg = ModelConfig(**NANO, moe=MoEConfig(**{"num_experts": 8, "top_k": 2, "expert_dim": 24, **moe}))
    torch.manual_seed(seed)
    m = MoE(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m


def token_by_token(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's output computed the plain way: each token, each of its chosen experts, one at a time."""
    scores, chosen, weights = route(m.router(x), m.m, m.expert_bias if m.m.balance == "bias" else None)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(m.m.top_k):
            e = int(chosen[t, k])
            w1, w2, w3 = m.experts.w1[e], m.experts.w2[e], m.experts.w3[e]
            out[t] += weights[t, k] * (w2 @ (F.silu(w1 @ x[t]) * (w3 @ x[t])))
    return out + (m.shared(x) if m.shared is not None else 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("moe", [{}, {"top_k": 1}, {"shared_experts": 1, "score": "sigmoid"}], ids=str)
def test_the_layer_is_each_token_through_its_chosen_experts(moe: dict):
    m = layer(**moe)
    x = torch.randn(2, 20, 32)
    want = token_by_token(m, x.reshape(-1, 32)).reshape(x.shape)
    torch.testing.assert_close(m(x), want, atol=1e-5, rtol=1e-5)
    assert m.figures[:8].sum() == 40 * m.m.top_k  # every token's copies counted, at their experts


@pytest.mark.timeout(60)
def test_an_expert_over_capacity_drops_its_last_tokens_and_counts_them():
    m = layer(capacity_factor=0.5)
    x = torch.randn(40, 32)
    _, chosen, weights = route(m.router(x), m.m, None)
    counts = torch.bincount(chosen.flatten(), minlength=8)
    capacity = 5  # 0.5 · 80 copies / 8 experts
    assert counts.max() > capacity, "the draw must overfill an expert for this test to mean anything"
    out = m(x)
    # The reference keeps, per expert, its first `capacity` copies in token order.
    kept = torch.zeros_like(chosen, dtype=torch.bool)
    seen = [0] * 8
    for t in range(40):
        for k in range(2):
            e = int(chosen[t, k])
            kept[t, k] = seen[e] < capacity
            seen[e] += 1
    want = torch.zeros_like(x)
    for t, k in kept.nonzero().tolist():
        e = int(chosen[t, k])
        w1, w2, w3 = m.experts.w1[e], m.experts.w2[e], m.experts.w3[e]
        want[t] += weights[t, k] * (w2 @ (F.silu(w1 @ x[t]) * (w3 @ x[t])))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert m.figures[-2] == (~kept).sum() == (counts - capacity).clamp(min=0).sum()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_the_auxiliary_losses_gradient_is_that_of_adding_them_to_the_loss(scale: float):
    """AuxLoss injects d(weight·balance + z_weight·z)/d(router) scaled as the step scales the model's loss."""
    x = torch.randn(30, 32)
    m = layer(aux_loss_weight=0.3, z_loss_weight=0.1)
    with aux_loss_scale(scale):
        (scale * m(x).pow(2).mean()).backward()
    injected = m.router.weight.grad.clone()

    m2 = layer(aux_loss_weight=0.3, z_loss_weight=0.1)
    m2.eval()  # no injection: the losses added by hand
    logits = m2.router(x)
    scores, _, _ = route(logits, m2.m, None)
    counts = torch.bincount(route(logits, m2.m, None)[1].flatten(), minlength=8)
    balance, z = m2.router_losses(logits, scores, counts)
    (scale * (m2(x).pow(2).mean() + 0.3 * balance + 0.1 * z)).backward()
    torch.testing.assert_close(injected, m2.router.weight.grad, atol=1e-6, rtol=1e-5)
    m3 = layer(aux_loss_weight=0.0)  # and they do move the router: without them its gradient is another
    (scale * m3(x).pow(2).mean()).backward()
    assert not torch.allclose(injected, m3.router.weight.grad, atol=1e-4)


@pytest.mark.timeout(60)
def test_the_loss_free_bias_moves_the_choice_towards_the_mean_load_and_not_the_weights():
    m = layer(balance="bias", bias_rate=0.01)
    toward = torch.ones(32) / 32**0.5
    with torch.no_grad():
        m.router.weight[0] = 1.5 * toward  # the tokens lean towards expert 0: most choose it
    x = torch.randn(200, 32) + 2 * toward
    m(x)
    load = m.figures[:8].clone()
    assert load.max() / load.mean() > 2
    m.balance(load)
    assert torch.equal(torch.sign(m.expert_bias), torch.sign(load.mean() - load))
    for _ in range(100):
        m.figures = None
        m(x)
        m.balance(m.figures[:8])
    after = m.figures[:8]
    assert after.max() / after.mean() < 1.5, after
    scores, chosen, weights = route(m.router(x), m.m, m.expert_bias)
    torch.testing.assert_close(weights, scores.gather(-1, chosen) / scores.gather(-1, chosen).sum(-1, keepdim=True))


@pytest.mark.timeout(60)
def test_the_family_record_counts_every_expert_and_flops_the_active_ones():
    moe = MoEConfig(num_experts=8, top_k=2, expert_dim=24, shared_experts=1, first_dense=1)
    cfg = ModelConfig(**NANO, moe=moe)
    with torch.device("meta"):
        model = build_model(cfg, 16)
    assert num_params(cfg) == sum(p.numel() for p in model.parameters())
    dense = dataclasses.replace(cfg, _target_="distrain.model.llama.Transformer", moe=MoEConfig())
    # block 1 has experts: its MLP (3·32·48) becomes the router (32·8) and 2 + 1 experts of 3·32·24 per token
    extra = 6 * (32 * 8 + 3 * 32 * 24 * 3 - 3 * 32 * 48)
    assert flops_per_token(cfg, 16) == flops_per_token(dense, 16) + extra


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("model.moe.num_experts=0", "model.moe.num_experts=0: the moe family needs at least 1 expert"),
        ("model.moe.top_k=9", "model.moe.top_k=9: must be 1 to num_experts=8"),
        ("model.moe.score=relu", "model.moe.score=relu: must be one of softmax, sigmoid"),
        ("model.moe.balance=loss", "model.moe.balance=loss: must be one of aux_loss, bias, none"),
        ("model.moe.expert_dim=0", "model.moe.expert_dim=0: must be ≥ 1"),
        ("model.moe.every=0", "model.moe.every=0: must be ≥ 1"),
        ("model.moe.shared_experts=-1", "model.moe.first_dense and shared_experts must be ≥ 0"),
        ("model.moe.capacity_factor=-1", "capacity_factor must be ≥ 0"),
        ("model.moe.first_dense=4", "model.moe: no block of 2 has experts (first_dense=4, every=1)"),
        # tensor parallelism splits the shared experts as a dense MLP (the routed ones stay whole)
        (
            "strategy=tp model.moe.shared_experts=1 model.moe.expert_dim=25",
            "strategy.tp=2 does not divide model.moe.shared_experts × expert_dim=25",
        ),
    ],
)
def test_a_moe_setting_that_cannot_work_is_refused_in_one_line(tmp_path, override: str, says: str):
    with pytest.raises(ConfigError) as err:
        validate(make_config(tmp_path, "model=moe_nano", *override.split()))
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.timeout(60)
def test_a_recomputed_block_counts_its_figures_once():
    """Activation checkpointing runs each block's forward again in the backward pass: the layer's figures (tokens
    per expert, dropped copies, forwards) are one forward's, as without it, even where torch recomputes the whole
    block (its early stop off)."""
    cfg = ModelConfig(
        **{**NANO, "n_layers": 1}, moe=MoEConfig(num_experts=8, top_k=2, expert_dim=24, capacity_factor=0.5)
    )
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    figures = []
    for recompute in (False, True):
        model = build_model(cfg, 16, seed=0)
        model.init_weights()
        apply_activation_checkpointing(model, SimpleNamespace(cfg=StrategyConfig(activation_checkpoint=recompute)))
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            model(tokens).float().logsumexp(-1).mean().backward()
        figures.append(moe_layers(model)[0].figures)
    assert figures[0][-2:].tolist() == [32.0, 1.0]  # copies dropped over capacity, forwards
    torch.testing.assert_close(figures[1], figures[0], atol=0, rtol=0)
