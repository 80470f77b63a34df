"""LoRA on a mixture of experts' routed experts (finetune.lora.targets=[..., experts]), on a Mixtral imported from
transformers: expert parallelism (whose adapters split with their experts) and ZeRO-3 over it (FSDP2 shards them
over the ranks holding the same experts), then tensor parallelism (the experts and their adapters whole on each
rank), each as one process trains the same adapters (10 steps, loss and gradient norm within 1e-4); the run trained
under expert parallelism exports an adapter peft loads with logits as distrain's (1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_matches, logged, train_half_then_resume

from distrain.driver.launch import train
from distrain.model.hf import resolve_init_from

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from test_hf import save_hf_model, tokens  # noqa: E402  (after transformers is known to be there)
from test_lora import LORA, STEPS, assert_peft_logits, lora_config  # noqa: E402

EXPERTS = "finetune.lora.targets=[attention,experts]"


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("base") / "hf"
    save_hf_model("mixtral", directory, "single")
    return directory


def experts_config(storage: Path, base: Path, name: str, workers: int, *overrides: str):
    return lora_config(storage, base, name, workers, EXPERTS, *overrides)


@pytest.fixture(scope="module")
def reference(ray_cluster, mixtral, tmp_path_factory) -> dict:
    cfg = resolve_init_from(experts_config(tmp_path_factory.mktemp("ref"), mixtral, "ref", 1), say=lambda line: None)
    assert train(cfg)["status"] == "completed"
    return {"loss": logged(cfg), "grad_norm": logged(cfg, "grad_norm")}


@pytest.mark.timeout(300)
def test_zero3_over_expert_parallelism_trains_the_expert_adapters_as_one_process(reference, mixtral, tmp_path: Path):
    """ZeRO-3 on 4 ranks with ep 2; then its checkpoint exported: peft's Mixtral with the adapter gives the logits
    of distrain's model with it, so every expert's adapters were trained, saved and placed where they belong."""
    from distrain.commands.export import export
    from distrain.driver.trained import load_trained
    from distrain.model.lora import LoRAExperts

    cfg = experts_config(tmp_path, mixtral, "zero3ep", 4, "strategy=zero3", "strategy.ep=2")
    assert train(cfg)["status"] == "completed"
    assert_matches(cfg, reference, range(1, STEPS + 1), tol=1e-4)
    _, ours = load_trained(cfg.run_dir)
    experts = ours.layers["0"].feed_forward.experts
    assert isinstance(experts, LoRAExperts) and experts.w1_lora_B.abs().min() > 0  # every expert's adapter trained
    x = tokens()
    with torch.no_grad():
        want = ours(x)
    out, _ = export(cfg.run_dir, tmp_path / "adapter")
    assert_peft_logits(mixtral, out, x, want)


@pytest.mark.timeout(300)
def test_expert_parallelism_then_tensor_parallelism_train_the_expert_adapters_as_one_process(
    reference, mixtral, tmp_path: Path
):
    """Half the run with ep 2 on 2 DDP ranks, the rest resumed from its checkpoint under 1-D tensor parallelism."""
    common = (f"model.init_from={mixtral}", *LORA, EXPERTS, "checkpoint.interval=5")
    cfg = train_half_then_resume(
        tmp_path, "ep-tp", (2, ["strategy=ddp", "strategy.ep=2"]), (2, ["strategy=tp"]), STEPS, *common
    )
    assert_matches(cfg, reference, range(1, STEPS + 1), tol=1e-4)
