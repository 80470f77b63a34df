"""LoRA fine-tuning (finetune.lora): the base never moves, every layout (context parallelism and CPU and NVMe
offload among them) trains the adapters as one process does (10 steps: loss, gradient norm and the adapters within
1e-4), the adapter loads into `peft` on the `transformers` base model and merges into its weights with logits
within 1e-5 of distrain's, checkpoints hold the adapters alone and refuse another base, and generate samples with
the adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_matches, final_weights, logged, make_config, train_half_then_resume
from safetensors.torch import save_file

from distrain.config import ConfigError, LoRAConfig, ModelConfig, OptimConfig, to_plain
from distrain.driver.finetune import base_fingerprint, check_base
from distrain.driver.launch import train
from distrain.driver.validation import validate
from distrain.model.contract import fill_parameters
from distrain.model.hf import hf_config, hf_weights, resolve_init_from, to_hf
from distrain.model.lora import LoRALinear, adapted_style, add_adapters, is_adapter
from distrain.model.lora_hf import adapter_files, merged_state
from distrain.model.registry import build_model
from distrain.train.optim import build_optimizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from test_hf import save_hf_model, tokens  # noqa: E402  (after transformers is known to be there)

TOL = 1e-5  # logits, fp32, against transformers and peft
LORA = ("finetune.lora.rank=4", "finetune.lora.alpha=8")
STEPS = 10


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["finetune.lora.targets=[attention,qkv]"], "qkv"),
        (["finetune.lora.rank=-1"], "finetune.lora.rank"),
        (["finetune.lora.alpha=0"], "finetune.lora.alpha"),
        (["finetune.lora.dropout=1.0"], "finetune.lora.dropout"),
        (["strategy=tp2d", "cluster.num_workers=4"], "strategy.tp_mode"),
        (["strategy=ps"], "ps.mode"),
        (["model=moe_nano", "strategy.ep=2"], "strategy.ep"),
        (["model=gpt2_nano", "finetune.lora.targets=[w3]"], "nothing in"),  # GPT-2's MLP has no w3
        (["trainer.float8=tensorwise"], "trainer.float8"),
    ],
)
def test_refused_in_one_line(overrides: list[str], key: str, tmp_path: Path):
    cfg = make_config(tmp_path, "finetune.lora.rank=4", *overrides)
    with pytest.raises(ConfigError, match=key) as error:
        validate(cfg)
    assert "\n" not in str(error.value)
    if key == "qkv":  # the valid names listed
        assert "attention, mlp, experts, wq" in str(error.value)


def test_a_checkpoint_of_other_adapters_or_of_another_base_is_refused(tmp_path: Path):
    """rerun.claimed's check of a LoRA run's newest checkpoint: the same adapters on the same base resume; other
    adapters, or another base (here: weights drawn from another seed), are refused in one line."""
    cfg = make_config(tmp_path, "run.name=r", *LORA)
    meta = {"config": to_plain(cfg), "base": base_fingerprint(cfg)}
    check_base(meta, cfg)
    for override, key in (("finetune.lora.rank=8", "finetune.lora="), ("trainer.seed=1", "another base model")):
        with pytest.raises(ConfigError, match=key) as error:
            check_base(meta, make_config(tmp_path, "run.name=r", *LORA, override))
        assert "\n" not in str(error.value)


def tiny(target: str = "distrain.model.llama.Transformer", **more) -> ModelConfig:
    """A small model; the moe family's with 4 experts in every block."""
    cfg = ModelConfig(_target_=target, name="t", dim=32, n_layers=2, n_heads=2, ffn_dim=64, **more)
    cfg.moe.num_experts = 4 if target.endswith("MoETransformer") else 0
    return cfg


def test_targets_matching_nothing_and_an_unknown_split_are_refused():
    with pytest.raises(ConfigError, match="no nn.Linear or routed experts") as error:  # GPT-2's MLP has no w3
        add_adapters(build_model(tiny("distrain.model.gpt2.GPT2"), 16), LoRAConfig(rank=2, targets=["w3"]), 0)
    assert "\n" not in str(error.value)
    model = add_adapters(build_model(tiny(), 16), LoRAConfig(rank=2), 0)
    from torch.distributed.tensor.parallel import SequenceParallel

    with pytest.raises(ValueError, match="no tensor-parallel split"):
        adapted_style(model, "layers.0.attention.wq", SequenceParallel())


@pytest.mark.parametrize(
    ("target", "targets"),
    [("distrain.model.llama.Transformer", ["attention", "mlp"]), ("distrain.model.moe.MoETransformer", ["experts"])],
)
def test_the_base_never_moves_and_only_the_adapters_train(target: str, targets: list[str]):
    """AdamW with weight decay over what build_optimizer is given, 3 steps: every base parameter keeps its bits (a
    frozen weight in the optimizer would decay), every adapter moves, and the adapted model started as the base.
    On a mixture of experts: the routed experts' adapters alone, every expert's."""
    base = build_model(tiny(target), 16)
    model = add_adapters(build_model(tiny(target), 16), LoRAConfig(rank=4, targets=targets), 0)
    x = tokens(seq_len=16)
    assert torch.equal(model(x), base(x))  # B starts at zero
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.5))
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if is_adapter(n)}
    for _ in range(3):
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) != is_adapter(name), name


# GPT-2: Q, K, V's adapters fused into c_attn's; Mixtral and Qwen3-MoE: the routed experts' too, w1's and w3's fused
# into gate_up_proj's, through PEFT's target_parameters (not Qwen3-MoE's dense block 0's MLP: see the next test)
TARGETS = {
    "llama_gqa": ["attention", "mlp"],
    "gpt2": ["attention", "mlp"],
    "mixtral": ["attention", "experts"],
    "qwen3_moe": ["attention", "experts"],
}


@pytest.mark.parametrize("name", TARGETS)
def test_the_adapter_loads_into_peft_and_merges(name: str, tmp_path: Path):
    save_hf_model(name, tmp_path / "hf", "single")
    cfg = resolve_init_from(make_config(tmp_path, f"model.init_from={tmp_path / 'hf'}"), say=lambda line: None)
    lora = LoRAConfig(rank=4, alpha=8.0, targets=TARGETS[name])
    model = add_adapters(build_model(cfg.model, cfg.trainer.seq_len), lora, 0)
    fill_parameters(model, hf_weights(cfg.model.init_from, cfg.model), only=lambda n: not is_adapter(n))
    with torch.no_grad():  # B drawn (it starts at zero): an adapter misplaced moves the logits
        for key, p in model.named_parameters():
            if key.endswith("lora_B"):
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(key)))
    x = tokens()
    with torch.no_grad():
        want = model(x)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config, tensors = adapter_files(model, cfg.model, lora, str(tmp_path / "hf"))
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    assert_peft_logits(tmp_path / "hf", adapter, x, want)
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "config.json").write_text(json.dumps(hf_config(cfg.model, cfg.trainer.seq_len)))
    save_file(to_hf(merged_state(model), cfg.model), str(merged / "model.safetensors"), metadata={"format": "pt"})
    assert_transformers_logits(merged, x, want)


def assert_peft_logits(base: Path, adapter: Path, x: torch.Tensor, want: torch.Tensor) -> None:
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    with torch.no_grad():
        assert (loaded(x).logits - want).abs().max() <= TOL


def assert_transformers_logits(directory: Path, x: torch.Tensor, want: torch.Tensor) -> None:
    with torch.no_grad():
        got = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()(x).logits
    assert (got - want).abs().max() <= TOL


def test_an_adapter_without_a_place_in_hf_is_refused_in_one_line():
    """The moe family's shared experts have no Hugging Face counterpart (Mixtral has none): their adapter neither.
    Nor has a Qwen3-MoE's dense MLP one peft would load it in: it reads gate_proj, up_proj and down_proj as the
    experts' (without the refusal its logits differ by about 2)."""
    cfg = tiny("distrain.model.moe.MoETransformer")
    cfg.moe.shared_experts = 1
    qwen3 = tiny("distrain.model.moe.MoETransformer", qk_norm=True)
    qwen3.moe.first_dense = 1
    for model_cfg, key in ((cfg, "no place"), (qwen3, "layers.0.mlp.down_proj's adapter: peft loads")):
        lora = LoRAConfig(rank=2, targets=["mlp", "experts"])
        model = add_adapters(build_model(model_cfg, 16), lora, 0)
        with pytest.raises(ConfigError, match=key) as error:
            adapter_files(model, model_cfg, lora, None)
        assert "\n" not in str(error.value) and "merge=true" in str(error.value)


@pytest.mark.parametrize(
    ("model", "targets"),
    [
        ([], "attention, mlp"),
        (["model=gpt2_nano"], "attention, mlp"),
        (["model=moe_nano", "model.moe.shared_experts=1", "model.moe.first_dense=1"], "attention, mlp, experts"),
    ],
)
def test_the_plan_counts_the_adapters_and_their_memory(model: list[str], targets: str, tmp_path: Path):
    """--plan: the adapters' parameters as the built model has them, the base frozen; the optimizer state and the
    gradients those of the adapters alone (on the same ZeRO-1 layout, full fine-tuning's hold them all)."""
    from distrain.driver.plan import describe, rank_memory

    cfg = make_config(tmp_path, *LORA, f"finetune.lora.targets=[{targets.replace(' ', '')}]", "strategy=zero1", *model)
    layout = validate(cfg)
    built = add_adapters(build_model(cfg.model, cfg.trainer.seq_len), cfg.finetune.lora, 0)
    trained = sum(p.numel() for p in built.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in built.parameters() if not p.requires_grad)
    text = describe(cfg, layout, None)
    assert f"rank 4, alpha 8 on {targets}: {trained:,} parameters trained" in text
    assert f"{frozen:,} frozen" in text
    lora, full = (
        rank_memory(cfg, layout, 0, "fp32"),
        rank_memory(make_config(tmp_path, "strategy=zero1", *model), layout, 0, "fp32"),
    )
    assert lora.optimizer / full.optimizer == pytest.approx(trained / frozen, rel=0.01)
    assert lora.grads / full.grads == pytest.approx(trained / frozen, rel=0.01)


# -- runs: one process, then every layout ------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("base") / "hf"
    save_hf_model("llama_gqa", directory, "single")
    return directory


def lora_config(storage: Path, base: Path, name: str, workers: int, *overrides: str):
    return make_config(
        storage, f"run.name={name}", f"cluster.num_workers={workers}", f"model.init_from={base}", *LORA,
        f"trainer.max_steps={STEPS}", "checkpoint.interval=5", *overrides,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(ray_cluster, base_model, tmp_path_factory):
    cfg = resolve_init_from(lora_config(tmp_path_factory.mktemp("ref"), base_model, "ref", 1), say=lambda line: None)
    assert train(cfg)["status"] == "completed"
    return cfg, {"loss": logged(cfg), "grad_norm": logged(cfg, "grad_norm")}, final_weights(cfg)  # the adapters


# DDP and TP: test_resumes_on_the_same_base_and_refuses_another, one half each.
LAYOUTS = {
    "zero1": (2, ["strategy=zero1"]),
    "zero2": (2, ["strategy=zero2"]),
    "zero3": (2, ["strategy=zero3"]),
    "pp": (2, ["strategy=pp"]),
    "cp": (2, ["strategy=cp"]),  # each rank half of every sequence, ring attention
    "offload": (2, ["strategy=offload"]),  # ZeRO-3, the frozen base too in host memory
    "nvme": (2, ["strategy=nvme"]),  # and the adapters' AdamW moments in files
    "hsdp": (4, ["strategy=hsdp"]),  # last: the 2-worker runs share warm workers
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_trains_the_adapters_as_one_process(layout: str, reference, base_model, tmp_path: Path):
    workers, overrides = LAYOUTS[layout]
    cfg = lora_config(tmp_path, base_model, layout, workers, *overrides)
    assert train(cfg)["status"] == "completed"
    assert_matches(cfg, reference[1], range(1, STEPS + 1), tol=1e-4)
    got = final_weights(resolve_init_from(cfg, say=lambda line: None))  # the model's shape: the base's
    assert got.keys() == reference[2].keys()
    for key, want in reference[2].items():
        assert (got[key] - want).abs().max() <= 1e-4, key


def test_the_checkpoint_holds_the_adapters_and_exports_to_peft(reference, base_model, tmp_path: Path):
    """The run's checkpoint: adapters and their optimizer state, no base weight, and the base's fingerprint. Exported
    alone, the adapter loads into peft on the transformers base; merged, into transformers; both as distrain's."""
    import torch.distributed.checkpoint as dcp

    from distrain.commands.export import export
    from distrain.driver.trained import checkpoint_path, load_trained
    from distrain.storage.checkpoint import read_meta

    cfg = reference[0]
    path = checkpoint_path(cfg.run_dir)
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    models = [k.removeprefix("model.") for k in keys if k.startswith("model.")]
    assert models and all(is_adapter(k) for k in models)
    assert read_meta(path)["base"] and len(read_meta(path)["base"]) == 16
    _, ours = load_trained(cfg.run_dir)
    x = tokens()
    with torch.no_grad():
        want = ours(x)
    assert isinstance(ours.layers["0"].attention.wq, LoRALinear)
    out, _ = export(cfg.run_dir, tmp_path / "adapter")
    assert sorted(p.name for p in out.glob("adapter_*")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert_peft_logits(base_model, out, x, want)
    merged, _ = export(cfg.run_dir, tmp_path / "merged", merge=True)
    assert_transformers_logits(merged, x, want)


@pytest.mark.timeout(300)
def test_resumes_on_the_same_base_and_refuses_another(reference, base_model, tmp_path: Path):
    """Half the run under DDP, the rest under TP from its checkpoint (adapters only; the base from model.init_from):
    every step as the one-process run's. The base's weights then changed in place: the rerun is refused in one line."""
    base = tmp_path / "hf"
    shutil.copytree(base_model, base)
    common = (f"model.init_from={base}", *LORA, "checkpoint.interval=5")
    cfg = train_half_then_resume(tmp_path, "resumed", (2, ["strategy=ddp"]), (2, ["strategy=tp"]), STEPS, *common)
    assert_matches(cfg, reference[1], range(1, STEPS + 1), tol=1e-4)
    from safetensors.torch import load_file

    weights = load_file(base / "model.safetensors")  # the same shape, one weight changed in place
    weights["model.norm.weight"] += 1.0
    save_file(weights, str(base / "model.safetensors"))
    rerun = make_config(tmp_path, "run.name=resumed", f"model.init_from={base}", *LORA, "trainer.max_steps=12")
    with pytest.raises(ConfigError, match="another base model") as error:
        train(rerun)
    assert "\n" not in str(error.value)


def test_generate_samples_with_the_adapter(reference, base_model, tmp_path: Path):
    """jobs/generate.py on the LoRA run, greedy: the tokens peft's model on the transformers base continues with."""
    from distrain.commands.export import export
    from distrain.commands.generate import generate
    from distrain.data.tokenizer import run_tokenizer
    from distrain.driver.trained import load_trained

    cfg = reference[0]
    args = {"run.storage": cfg.run.storage, "run.name": "ref", "prompt": "def ", "max_new_tokens": 8}
    text = generate(args | {"temperature": 0.0, "top_k": 0, "seed": 0, "step": None, "device": "cpu"})
    out, _ = export(cfg.run_dir, tmp_path / "adapter")
    tokenizer = run_tokenizer(load_trained(cfg.run_dir)[0])
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_model), out).eval()
    loaded.generation_config.eos_token_id = None
    prompt = torch.tensor([tokenizer.encode("def ")])
    theirs = loaded.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)[0].tolist()
    ours = tokenizer.encode(text)
    assert len(ours) > prompt.shape[1] and ours == theirs[: len(ours)]  # generate stops early at the tokenizer's end
