"""The moe family's training (distrain/model/moe.py; the layer alone: tests/test_moe_layer.py) under data
parallelism, HSDP (ZeRO-3 on a 2-D mesh), context parallelism, 1-D tensor parallelism and expert parallelism (alone,
with DDP and activation checkpointing, with HSDP, with ZeRO-3 sharding the experts too, with cp, with tp, with a
looped pipeline and recomputation, with ZeRO-1) exactly as one process trains it, and checkpoints resumed across ep
sizes and layouts (ep 2 → none, ep 4 → ep 2, none → ep 2, pp × ep 2 → ep 2, ZeRO-3 × ep 2 → DDP × ep 2).
Tolerances, absolute and relative: 1e-5 where only the data or the experts are split (fp32, sums in another
order); 1e-4 under a pipeline, context and tensor parallelism. Expert parallelism's layout and bytes:
tests/test_expert_parallel.py."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import assert_matches, final_weights, make_config, train_half_then_resume

from distrain.config import TrainConfig
from distrain.driver.launch import train

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
    # HSDP: the rest sharded over dp_shard 2 by FSDP2, whose ranks ep borrows; the experts split by ep alone (no
    # rank of a replica left to shard them over: they stay out of FSDP2)
    "hsdpep2": (4, ["strategy=zero3", "strategy.dp_replicate=2", "strategy.dp_shard=2", "strategy.ep=2"], 1e-5),
    # ZeRO-3 over 4, ep 2: FSDP2 shards the rest over 4 and each half of the experts over the 2 ranks holding it
    # (ep_rest), reduce-scattering their gradients there, divided by 4
    "zero3ep2": (4, ["strategy=zero3", "strategy.ep=2"], 1e-5),
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
    ("bias", "zero3ep2"),
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
    [("aux", "ep4", 4), ("aux", "ddp", 2), ("deep", "ppep2", 4), ("bias", "zero3ep2", 4)],
    ids=["ep4-to-ep2", "ep1-to-ep2", "ppep2-to-ep2", "zero3ep2-to-ep2"],
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
