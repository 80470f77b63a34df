"""The moe family (distrain/model/moe.py): its layer against a token-by-token reference that shares none of its
dispatch, its capacity, its balancing (the auxiliary loss's gradient and the loss-free bias), its size record,
and its training under data parallelism, HSDP (ZeRO-3 on a 2-D mesh), context parallelism, 1-D tensor parallelism
and expert parallelism (alone, with DDP and activation checkpointing, with HSDP, with cp, with tp, with a looped
pipeline and recomputation, with ZeRO-1) exactly as one process trains it, and checkpoints resumed across ep sizes
and layouts (ep 2 → none, ep 4 → ep 2, none → ep 2, pp × ep 2 → ep 2). Tolerances, absolute and relative: 1e-5
for the layer against the reference (fp32, sums in another order) and where only the data or the experts are split;
1e-4 under a pipeline, context and tensor parallelism. Expert parallelism's layout and bytes:
tests/test_expert_parallel.py."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_matches, final_weights, make_config, train_half_then_resume

from distrain.config import ConfigError, ModelConfig, MoEConfig, TrainConfig
from distrain.driver.launch import train
from distrain.driver.validation import validate
from distrain.model.moe import MoE, aux_loss_scale, route
from distrain.model.registry import build_model
from distrain.model.size import flops_per_token, num_params

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


STEPS = 6
MODELS = {
    # Switch's balance loss and the z-loss, two experts per token
    "aux": ["model=moe_nano", "model.moe.z_loss_weight=0.01"],
    # the loss-free bias (its updates need the whole batch's load), one expert per token, a shared expert, and a
    # dense first block
    "bias": [
        "model=moe_nano",
        "model.moe.balance=bias",
        "model.moe.bias_rate=0.01",
        "model.moe.top_k=1",
        "model.moe.shared_experts=1",
        "model.moe.first_dense=1",
    ],
}
# four blocks, the first dense: a looped pipeline of 2 ranks holds 2 stages each, rank 0's first without experts
MODELS["deep"] = [*MODELS["aux"], "model.n_layers=4", "model.moe.first_dense=1"]
COMMON = (
    f"trainer.max_steps={STEPS}",
    f"checkpoint.interval={STEPS // 2}",  # the step a resume under another layout starts from
    "model.dim=32",
    "model.n_layers=2",
    "model.ffn_dim=48",
    "model.moe.expert_dim=24",
)
LAYOUTS = {
    "ddp": (2, ["strategy=ddp"], 1e-5),
    "hsdp": (4, ["strategy=zero3", "strategy.dp_replicate=2", "strategy.dp_shard=2"], 1e-5),  # a 2-D gradient mesh
    # each rank a share of every sequence: the balance loss's shares are counted over whole sequences
    "cp": (2, ["strategy.cp=2"], 1e-4),
    # expert parallelism borrows ranks of the gradient group: every rank its 8 / ep experts, tokens all-to-all
    "ep4": (4, ["strategy.ep=4"], 1e-5),  # all four ranks split the experts (2 each)
    # DDP over 4, each expert on 2 ranks (their gradients summed over 2), the exchanges rerun by the recomputation
    "dp2ep2": (4, ["strategy.ep=2", "strategy.activation_checkpoint=true"], 1e-5),
    # HSDP: the rest sharded over dp_shard 2 by FSDP2, whose ranks ep borrows; the experts split by ep alone
    "hsdpep2": (4, ["strategy=zero3", "strategy.dp_replicate=2", "strategy.dp_shard=2", "strategy.ep=2"], 1e-5),
    # 1-D TP with sequence parallelism: both ranks route the same (gathered) tokens through whole experts
    "tp2": (2, ["strategy.tp=2"], 1e-4),
    # tp 2 × dp 2, ep 2 borrowing dp: each tp index its own ep group; the shared expert split over tp
    "tpep2": (4, ["strategy.tp=2", "strategy.ep=2"], 1e-4),
    # pp 2 × dp 2, 2 stages a rank: each stage's two ranks split its block's experts, their all-to-alls in the
    # schedule's order (the shapes' inference, the recomputation's too); the aux loss's gradient scaled by the pipeline
    "ppep2": (
        4,
        ["strategy=pp", "strategy.schedule=interleaved_1f1b", "strategy.ep=2", "strategy.activation_checkpoint=true"],
        1e-4,
    ),
    # ZeRO-1 over 4: the other weights' state sharded by ZeroRedundancyOptimizer, the experts' (each on 2 ranks)
    # whole, stepped by an optimizer of their own
    "zero1ep2": (4, ["strategy=zero1", "strategy.ep=2"], 1e-5),
}
CASES = [
    ("aux", "ddp"),
    ("bias", "ddp"),
    ("bias", "hsdp"),
    ("aux", "cp"),
    ("aux", "tp2"),
    ("aux", "ep4"),
    ("bias", "dp2ep2"),
    ("aux", "hsdpep2"),
    ("bias", "tpep2"),
    ("deep", "ppep2"),
    ("bias", "zero1ep2"),
]


@pytest.fixture(scope="module")
def references(ray_cluster, tmp_path_factory) -> dict:
    """Per model: the one-process run's logged lines and final weights."""
    refs = {}
    for name, overrides in MODELS.items():
        cfg = make_config(tmp_path_factory.mktemp(name), "run.name=ref", "cluster.num_workers=1", *COMMON, *overrides)
        assert train(cfg)["status"] == "completed"
        refs[name] = {"lines": lines(cfg), "weights": final_weights(cfg)}
    return refs


def lines(cfg) -> dict[int, dict]:  # noqa: ANN001
    from distrain.storage.tracking import read_metrics

    return {m["step"]: m for m in read_metrics(cfg.run_dir)}


@pytest.fixture(scope="module")
def layout_runs(ray_cluster, tmp_path_factory) -> Callable[[str, str], TrainConfig]:
    """(model, layout) → the config of its run, trained once for the module: a parity case's, and the checkpoints
    a resume under another ep starts from."""
    runs = {}

    def run(model: str, layout: str) -> TrainConfig:
        if (model, layout) not in runs:
            workers, overrides, _ = LAYOUTS[layout]
            storage, name = tmp_path_factory.mktemp(f"{model}_{layout}"), f"run.name={model}_{layout}"
            cfg = make_config(storage, name, f"cluster.num_workers={workers}", *COMMON, *MODELS[model], *overrides)
            assert train(cfg)["status"] == "completed"
            runs[model, layout] = cfg
        return runs[model, layout]

    return run


def assert_as_one_process(got: dict, want: dict, steps: range, tol: float) -> None:
    """Each step's loss, gradient norm and routers' figures as the one-process run logged them."""
    figures = [k for k in want[1] if k.startswith("moe_")]
    assert {"moe_balance_loss", "moe_imbalance_1"} <= set(figures), figures
    for step in steps:
        for key in ("loss", "grad_norm", *figures):
            assert got[step].get(key) == pytest.approx(want[step][key], rel=tol, abs=tol), f"{key} at step {step}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("model", "layout"), CASES)
def test_moe_trains_as_one_process(model: str, layout: str, references, layout_runs):
    """Losses, gradient norms, the routers' figures (their loads summed over the ranks, and under a pipeline over
    the stages) and the final weights, the loss-free biases among them, are the one-process run's."""
    tol = LAYOUTS[layout][2]
    cfg = layout_runs(model, layout)
    want, got = references[model]["lines"], lines(cfg)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_as_one_process(got, want, range(1, STEPS + 1), tol)
    weights = final_weights(cfg)
    assert weights.keys() == references[model]["weights"].keys()
    for name, tensor in references[model]["weights"].items():
        torch.testing.assert_close(weights[name], tensor, atol=tol, rtol=0, msg=f"{model} {layout}: {name}")
    if model == "bias":
        assert references[model]["weights"]["layers.1.feed_forward.expert_bias"].abs().sum() > 0


@pytest.mark.timeout(300)
def test_an_expert_parallel_checkpoint_resumes_without_expert_parallelism(references, tmp_path):
    """Half the run with ep 2 borrowing the ranks of context parallelism (cp 2: each rank half of every sequence;
    the experts saved as shards of their full tensors), the rest in one process from its checkpoint: the losses and
    gradient norms are the uninterrupted one-process run's, before the resumption and after."""
    first = (2, ["strategy.cp=2", "strategy.ep=2"])
    cfg = train_half_then_resume(tmp_path, "ep_to_one", first, (1, []), STEPS, *COMMON, *MODELS["bias"])
    want = references["bias"]["lines"]
    assert_matches(cfg, {k: {s: want[s][k] for s in want} for k in ("loss", "grad_norm")}, range(1, STEPS + 1), 1e-4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("model", "source", "workers"),
    [("aux", "ep4", 4), ("aux", "ddp", 2), ("deep", "ppep2", 4)],
    ids=["ep4-to-ep2", "ep1-to-ep2", "ppep2-to-ep2"],
)
def test_a_checkpoint_resumes_under_another_ep(
    model: str, source: str, workers: int, references, layout_runs, tmp_path
):
    """A parity run's step-3 checkpoint (ep 4 on 4 ranks: 2 experts each; no EP on 2; or a pipeline's, each stage's
    2 ranks 4 of its blocks' experts) resumed with ep 2 on as many ranks and no pipeline (4 experts each, the
    optimizer's moments too, resharded by DCP): steps 4 to 6 are the one-process run's within 1e-5, as every EP
    layout's are (within the source's tolerance); and step 4's loss, a forward of the loaded weights alone, is the
    uninterrupted run's to the bit. Later steps need not be: ep 2 sums each expert's gradient in another order
    (over the ranks holding it) than ep 4 or DDP does (measured: step 5's loss differs from DDP's in its last bits,
    step 6's gradient norm from ep 4's)."""
    before, half = layout_runs(model, source), STEPS // 2
    step = f"step_{half:08d}"
    shutil.copytree(Path(before.run_dir) / "checkpoints" / step, tmp_path / "resumed" / "checkpoints" / step)
    cfg = make_config(
        tmp_path, "run.name=resumed", f"cluster.num_workers={workers}", *COMMON, *MODELS[model], "strategy.ep=2"
    )
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["resumed_from"].endswith(step)
    got = lines(cfg)
    assert sorted(got) == list(range(half + 1, STEPS + 1))
    assert_as_one_process(got, references[model]["lines"], range(half + 1, STEPS + 1), max(1e-5, LAYOUTS[source][2]))
    assert got[half + 1]["loss"] == lines(before)[half + 1]["loss"]
