"""The model contract and registry: both shipped families (Llama; GPT-2 with its tied head) and a user's
model living outside the package train under DDP, ZeRO-3, tensor and pipeline parallelism (and both families
under 3-D: pipeline × FSDP × TP on 8 ranks) exactly as one process does, the user's with experts under expert
parallelism too; checkpoints move between layouts; bad targets are one-line errors before any worker.

Tolerances, absolute and relative: 1e-5 on each step's loss and gradient norm and on every final weight
where only the data is split (DDP, ZeRO-3); 1e-4 where tensor or pipeline parallelism reorders sums."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, assert_matches, final_weights, logged, make_config, train_half_then_resume

from distrain.config import ConfigError
from distrain.driver.launch import train
from distrain.driver.validation import validate

STEPS = 6
COMMON = (f"trainer.max_steps={STEPS}", "model.n_layers=4")
EXAMPLES = REPO / "examples"
FAMILIES = {
    "llama": [],
    "gpt2": ["model=gpt2_nano"],  # tied head and embedding, learned positions, biases, LayerNorm
    # A model defined outside distrain (examples/user_model/decoder.py), found by PYTHONPATH.
    "user": [
        "model._target_=user_model.decoder.Decoder",
        "model.name=decoder",
        f"+cluster.env_vars.PYTHONPATH={EXAMPLES}",
    ],
}
# The same with 4 experts in every block (distrain's MoE layer, the contract of docs/models.md)
FAMILIES["user_moe"] = [*FAMILIES["user"], "model.moe.num_experts=4", "model.moe.expert_dim=32"]
LAYOUTS = {
    # id: (workers, overrides, tolerance)
    "ddp": (2, ["strategy=ddp"], 1e-5),
    "zero3": (2, ["strategy=zero3"], 1e-5),
    "tp": (2, ["strategy=tp"], 1e-4),
    "pp": (2, ["strategy=pp", "strategy.schedule=1f1b"], 1e-4),
    "ep": (2, ["strategy.ep=2"], 1e-5),  # each rank 2 of the 4 experts, their tokens exchanged
    # pipeline × FSDP × TP on 8 ranks: the tied head's copy is a DTensor sharded two ways (4 of the 6 steps)
    "3d": (8, ["strategy=3d", "trainer.max_steps=4", f"optim.decay_steps={STEPS}"], 1e-4),
}
CASES = [(f, lay) for f in ("llama", "gpt2", "user") for lay in ("ddp", "zero3", "tp", "pp")]
CASES.remove(("user", "tp"))
CASES += [("user_moe", "ep")]  # the user's model with experts, under expert parallelism
# The user's model has no TP plan. The two 3-D runs (test_strategies.py's 3-D parity is Llama's here) come one
# after the other, last: the second takes the first's 8 warm workers, whose start costs more than their 4 steps.
CASES += [("llama", "3d"), ("gpt2", "3d")]


@pytest.fixture(scope="module", autouse=True)
def user_model_importable():
    """The driver imports the user's module too (to check it), from sys.path as PYTHONPATH would set it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLES))
        yield


def without_tp_plan(cfg, max_seq_len: int, seed: int):  # noqa: ANN001, ANN201
    """A target that is a function, returning a model that lacks part of the contract."""
    from user_model.decoder import Decoder

    model = Decoder(cfg, max_seq_len, seed)
    model.tp_plan = None
    return model


BROKEN = {"part": None}  # what `broken` leaves out, set by the test


def broken(cfg, max_seq_len: int, seed: int):  # noqa: ANN001, ANN201
    """A target returning the user's Decoder without one part of the contract (BROKEN["part"])."""
    from torch import nn
    from user_model.decoder import Decoder

    from distrain.model.contract import ATTRIBUTES, METHODS

    model, part = Decoder(cfg, max_seq_len, seed), BROKEN["part"]
    blocks = list(model.layers.values())
    if part == "module":
        return 3
    if part == "layers":
        model.layers = nn.ModuleList(blocks)
    elif part == "layer_keys":
        model.layers = nn.ModuleDict({str(i + 1): block for i, block in enumerate(blocks)})
    elif part in METHODS:
        setattr(model, part, None)
    elif part in ATTRIBUTES:
        model.__class__ = type("Lacking", (Decoder,), {part: property(lambda self: self.no_such)})
    elif part == "named_module":
        model.output_modules = ("final_norm", "lm_head")
    return model


@pytest.mark.parametrize(
    ("part", "lacks"),
    [
        ("module", "it returned a int, not a torch.nn.Module"),
        ("layers", "lacks `layers` (an nn.ModuleDict of the blocks keyed '0'..'n-1')"),
        ("layer_keys", "lacks `layers` keyed '0'..'1' in order (has ['1', '2']...)"),
        *(
            (name, f"lacks the method `{name}`")
            for name in ("init_weights", "tp_plan", "grid_tp_plan", "flops_per_token")
        ),
        *((name, f"lacks the attribute `{name}`") for name in ("input_modules", "output_modules", "tied_parameters")),
        ("named_module", "lacks the module `lm_head` its input_modules/output_modules name"),
    ],
    ids=lambda value: value if " " not in value else "",
)
def test_each_part_of_the_contract_is_checked_before_workers(tmp_path: Path, monkeypatch, part: str, lacks: str):
    monkeypatch.setitem(BROKEN, "part", part)
    with pytest.raises(ConfigError) as err:
        validate(make_config(tmp_path, "run.name=bad", "model._target_=test_models.broken", "model.n_layers=2"))
    assert lacks in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.fixture(scope="module")
def references(ray_cluster, tmp_path_factory) -> dict:
    """Per family: the one-process run's losses, gradient norms and final weights."""
    refs = {}
    for family, overrides in FAMILIES.items():
        tmp = tmp_path_factory.mktemp(f"ref_{family}")
        cfg = make_config(tmp, "run.name=ref", "cluster.num_workers=1", *COMMON, *overrides)
        assert train(cfg)["status"] == "completed"
        refs[family] = {"loss": logged(cfg), "grad_norm": logged(cfg, "grad_norm"), "weights": final_weights(cfg)}
    return refs


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("family", "layout"), CASES)
def test_family_matches_one_process(family: str, layout: str, references, tmp_path: Path):
    workers, overrides, tol = LAYOUTS[layout]
    cfg = make_config(
        tmp_path,
        f"run.name={family}_{layout}",
        f"cluster.num_workers={workers}",
        *COMMON,
        *FAMILIES[family],
        *overrides,
    )
    assert train(cfg)["status"] == "completed"
    want, steps = references[family], cfg.trainer.max_steps
    assert sorted(logged(cfg)) == list(range(1, steps + 1))
    assert_matches(cfg, want, range(1, steps + 1), tol)
    if family == "user_moe":  # its layers found by block, as the shipped family's are: balanced and logged
        assert sorted(logged(cfg, f"moe_imbalance_{cfg.model.n_layers - 1}")) == list(range(1, steps + 1))
    if steps < STEPS:
        return
    weights = final_weights(cfg)
    assert weights.keys() == want["weights"].keys()
    for name, tensor in want["weights"].items():
        torch.testing.assert_close(weights[name], tensor, atol=tol, rtol=0, msg=f"{family} {layout}: {name}")
    if family == "gpt2":  # the tied head stayed tied: the checkpoint's two names hold one value
        torch.testing.assert_close(weights["output.weight"], weights["tok_embeddings.weight"], atol=0, rtol=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", ["pp_to_ddp", "ddp_to_pp"])
def test_gpt2_resumes_across_pipeline_layouts(order: str, references, tmp_path: Path):
    """Half a GPT-2 run under one layout, the rest under the other from its checkpoint: the tied head,
    a copy of its own on the last pipeline stage, is saved and loaded under both names."""
    pp, ddp = (2, ["strategy=pp"]), (1, ["strategy=ddp"])
    first, then = (pp, ddp) if order == "pp_to_ddp" else (ddp, pp)
    cfg = train_half_then_resume(tmp_path, order, first, then, STEPS, *COMMON, *FAMILIES["gpt2"])
    assert_matches(cfg, references["gpt2"], range(STEPS // 2 + 1, STEPS + 1), 1e-4)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model._target_=distrain.model.gtp2.GPT2"],
            "no module named distrain.model.gtp2; did you mean distrain.model.gpt2.GPT2?",
        ),
        (
            ["model._target_=distrain.model.gpt2.GTP2"],
            "distrain.model.gpt2 has no attribute GTP2; did you mean distrain.model.gpt2.GPT2?",
        ),
        (["model._target_=mypkg.models.Net"], "no module named mypkg; "),
        (["model._target_=distrain.model.families.FAMILIES"], "is a dict, not a class or function"),
        (["model._target_=torch.nn.Identity"], "the model lacks `layers`"),
        (["model._target_=test_models.without_tp_plan"], "the model lacks the method `tp_plan`"),
        (["model=gpt2_nano", "strategy=tp2d", "cluster.num_workers=4"], "has no plan for it; use strategy.tp_mode=1d"),
        (["model._target_=user_model.decoder.Decoder", "strategy=tp"], "has no plan for it; use a strategy without"),
        (["model=gpt2_nano", "trainer.seq_len=512"], "trainer.seq_len=512 exceeds model.n_positions=256"),
    ],
)
def test_a_bad_model_is_one_line_before_workers(tmp_path: Path, overrides: list[str], expected: str):
    with pytest.raises(ConfigError) as err:
        validate(make_config(tmp_path, "run.name=bad", *overrides))
    assert expected in str(err.value) and "\n" not in str(err.value)


@pytest.mark.timeout(180)
def test_a_user_model_trains_from_the_command_line(tmp_path: Path):
    """As docs/models.md says: PYTHONPATH names the directory of the user's package and the target is
    given by config alone; the embedded cluster's workers import it (ZeRO-3 on 2 workers)."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(EXAMPLES)}
    env.pop("RAY_ADDRESS", None)
    args = [a for a in TINY if not a.startswith("cluster.reuse_workers")]
    result = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "train.py"), *args, f"run.storage={tmp_path}", "run.name=user"]
        + ["model._target_=user_model.decoder.Decoder", "model.name=decoder", "strategy=zero3"]
        + ["cluster.num_workers=2", "cluster.local_cpus=2", "cluster.local_gpus=0", "trainer.max_steps=3"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # not the repository: the module comes from PYTHONPATH alone
        timeout=170,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(logged(make_config(tmp_path, "run.name=user"))) == [1, 2, 3]
