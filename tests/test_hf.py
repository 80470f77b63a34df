"""Hugging Face interop checked against `transformers` itself: tiny random models built locally (no
download), imported into distrain with model.init_from; distrain runs trained under TP and FSDP (a mixture of
experts under expert parallelism, as Mixtral and as Qwen3-MoE), exported, and loaded by `transformers`. Logits
agree to 1e-5 in fp32 on the same tokens, both ways, every family; greedy continuations are the same tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, logged, make_config

from distrain.config import ConfigError
from distrain.data.loader import run_batches
from distrain.data.tokenizer import run_tokenizer
from distrain.driver.launch import train
from distrain.driver.trained import load_trained
from distrain.model.contract import fill_parameters
from distrain.model.hf import hf_config, hf_weights, resolve_init_from, to_hf
from distrain.model.registry import build_model

transformers = pytest.importorskip("transformers")

TOL = 1e-5
# Weights larger than transformers' default 0.02, so attention is far from uniform: a wrong rotary row
# order or Q/K/V split moves the logits by ~1, not 1e-4.
INIT = 0.1
HF_MODELS = {
    "llama_gqa": lambda: transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=500.0, rms_norm_eps=1e-5, initializer_range=INIT,
        tie_word_embeddings=False,
    ),
    "llama_tied": lambda: transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        initializer_range=INIT, tie_word_embeddings=True,
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, initializer_range=INIT,
    ),
    # Qwen3: per-head norms of Q and K, heads wider than hidden_size / heads (16, not 8), a tied head
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=INIT, tie_word_embeddings=True,
    ),
    # Qwen3-MoE: its own head width, block 0 dense (mlp_only_layers) and its MLP wider than the experts, the
    # chosen experts' weights not renormalised (norm_topk_prob)
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, mlp_only_layers=[0], initializer_range=INIT,
    ),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=64, initializer_range=INIT,
        bos_token_id=None, eos_token_id=None,
    ),
}  # fmt: skip


def save_hf_model(name: str, directory: Path, files: str = "sharded") -> transformers.PreTrainedModel:
    """`files`: sharded (several files and their index, as large models are saved), single (one
    model.safetensors: most small models, and distrain's export) or bare (one file of the base model's
    names, without `transformer.`: GPT-2's original checkpoints)."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(HF_MODELS[name]()).eval()
    with torch.no_grad():  # norms' gains drawn too (transformers sets them to 1): a misplaced gain shows
        for key, p in model.named_parameters():
            if "norm" in key:
                p.normal_(1.0, 0.5)
    model.save_pretrained(directory, max_shard_size="40KB" if files == "sharded" else "1GB")
    if files == "bare":
        weights = load_file(directory / "model.safetensors")
        save_file({k.removeprefix("transformer."): v for k, v in weights.items()}, directory / "model.safetensors")
    return model


def tokens(vocab: int = 256, seq_len: int = 32) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    ("name", "files"),
    [*((name, "sharded") for name in HF_MODELS), ("llama_gqa", "single"), ("gpt2", "single"), ("gpt2", "bare")],
)
def test_import_matches_transformers(name: str, files: str, tmp_path: Path):
    reference = save_hf_model(name, tmp_path / "hf", files)
    found = sorted(p.name for p in (tmp_path / "hf").glob("model*.safetensors*"))
    assert len(found) > 2 if files == "sharded" else found == ["model.safetensors"]
    cfg = resolve_init_from(make_config(tmp_path, f"model.init_from={tmp_path / 'hf'}"), say=lambda line: None)
    assert (cfg.model.dim, cfg.model.vocab_size) == (reference.config.hidden_size, 256)
    assert cfg.model.tie_embeddings == reference.config.tie_word_embeddings
    model = build_model(cfg.model, cfg.trainer.seq_len)
    fill_parameters(model, hf_weights(cfg.model.init_from, cfg.model))
    x = tokens()
    with torch.no_grad():
        got, want = model(x), reference(x).logits
    assert (got - want).abs().max() <= TOL
    if files != "sharded":
        return
    from safetensors.torch import save_file

    from distrain.commands.generate import sample

    reference.generation_config.eos_token_id = None  # the greedy continuation of a prompt, token for token
    prompt = x[:1, :4]
    theirs = reference.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist()
    assert sample(model, prompt[0].tolist(), 12, cfg.trainer.seq_len) == theirs
    # Back out as jobs/export.py writes it (hf_config, to_hf): transformers reads the model it was given.
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config(cfg.model, cfg.trainer.seq_len)))
    save_file(to_hf(model.state_dict(), cfg.model), str(out / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        assert (transformers.AutoModelForCausalLM.from_pretrained(out).eval()(x).logits - want).abs().max() <= TOL


def hf_dir(tmp_path: Path, config: dict | str) -> Path:
    """A model directory of this config.json alone: refusals come before any weight is read."""
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return directory


LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 2}
LLAMA |= {"num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 256}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_head": 2, "n_layer": 2, "n_positions": 64}
GPT2 |= {"vocab_size": 256}
QWEN3 = {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 8}
QWEN3_MOE = {**QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 4, "num_experts": 4}
QWEN3_MOE |= {"num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": []}


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({**LLAMA, "architectures": ["MistralForCausalLM"]}, "architecture"),
        ({**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({**LLAMA, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "rope_parameters"),
        ({**LLAMA, "attention_bias": True}, "attention_bias"),
        ({**LLAMA, "mlp_bias": True}, "mlp_bias"),
        ({**QWEN3_MOE, "mlp_only_layers": [1]}, "mlp_only_layers"),  # block 1 dense after block 0's experts
        ({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3]}, "mlp_only_layers"),  # 3 after 1
        ({**QWEN3, "use_sliding_window": True}, "use_sliding_window"),
        ({**QWEN3, "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({**LLAMA, "hidden_act": "gelu"}, "hidden_act"),
        ({**GPT2, "activation_function": "relu"}, "activation_function"),
        ({**GPT2, "scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ({k: v for k, v in LLAMA.items() if k != "num_attention_heads"}, "num_attention_heads"),
        (LLAMA, "model.safetensors"),  # no weights
        ("{not json", "config.json"),
    ],
)
def test_unsupported_model_refused_in_the_driver(config: dict | str, key: str, tmp_path: Path):
    cfg = make_config(tmp_path, f"model.init_from={hf_dir(tmp_path, config)}")
    with pytest.raises(ConfigError, match=key) as error:
        train(cfg)  # before Ray: no cluster fixture here
    assert "\n" not in str(error.value) and "model.init_from" in str(error.value)
    assert not Path(cfg.run_dir).exists()


def test_unsupported_architecture_one_line_exit_2(tmp_path: Path):
    directory = hf_dir(tmp_path, {**LLAMA, "architectures": ["BertForMaskedLM"]})
    result = subprocess.run(
        [sys.executable, "jobs/train.py", f"model.init_from={directory}", f"run.storage={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "BertForMaskedLM" in result.stderr


FAMILIES = {"llama": [], "gpt2": ["model=gpt2_nano"]}
STRATEGIES = {"tp": ["strategy=tp"], "zero3": ["strategy=zero3"], "ps": ["strategy=ps"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_trained_run_exports_to_transformers(family: str, strategy: str, ray_cluster, tmp_path: Path):
    from distrain.commands.export import export

    cfg = make_config(
        tmp_path, f"run.name={family}-{strategy}", "cluster.num_workers=2", "trainer.max_steps=3",
        *FAMILIES[family], *STRATEGIES[strategy],
    )  # fmt: skip
    summary = train(cfg)
    assert summary["status"] == "completed"
    out, _ = export(cfg.run_dir, tmp_path / "export")
    _, ours = load_trained(cfg.run_dir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = tokens(seq_len=cfg.trainer.seq_len)
    xv, yv = run_batches(cfg)[1].get(0)  # the final evaluation's batch (trainer.eval_batches=1)
    with torch.no_grad():
        assert (ours(x) - theirs(x).logits).abs().max() <= TOL
        # Independent of load_trained: the workers' own loss on the trained weights.
        val_loss = F.cross_entropy(theirs(xv).logits.flatten(0, 1), yv.flatten()).item()
    assert val_loss == pytest.approx(summary["final_val_loss"], abs=TOL)
    text = "def export(run):\n    return 'ünïcode' * 3\n"
    assert transformers.AutoTokenizer.from_pretrained(out).encode(text) == run_tokenizer(cfg).encode(text)
    with pytest.raises(ConfigError, match="not empty"):
        export(cfg.run_dir, out)


# A mixture of experts trained under expert parallelism, and the counterpart it exports to.
EXPORTED_MOE = {
    "mixtral": ([], "MixtralForCausalLM"),
    # Qwen3's attention (per-head norms of Q and K, heads 48 wide where dim / n_heads is 16); of 4 blocks, experts
    # in block 3 only (every 2nd from block 2: decoder_sparse_step 2, mlp_only_layers [0, 1]), the others an MLP;
    # the chosen experts' weights not renormalised
    "qwen3_moe": (
        ["model.qk_norm=true", "model.head_dim=48", "model.n_layers=4", "model.moe.every=2",
         "model.moe.first_dense=2", "model.moe.normalize=false"],
        "Qwen3MoeForCausalLM",
    ),
}  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", EXPORTED_MOE)
def test_an_expert_parallel_run_exports_and_decodes_as_transformers_does(name: str, ray_cluster, tmp_path: Path):
    """Trained with its 4 experts split over 2 ranks; transformers' Mixtral (Qwen3-MoE) gives the same logits, and
    its greedy continuation is jobs/generate.py's."""
    from distrain.commands.export import export
    from distrain.commands.generate import generate

    overrides, architecture = EXPORTED_MOE[name]
    cfg = make_config(
        tmp_path, f"run.name={name}", "model=moe_nano", "model.moe.num_experts=4", "model.moe.expert_dim=48",
        "cluster.num_workers=2", "strategy.ep=2", "trainer.max_steps=12", *overrides,
    )  # fmt: skip
    assert train(cfg)["status"] == "completed"
    out, _ = export(cfg.run_dir, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["architectures"] == [architecture]
    _, ours = load_trained(cfg.run_dir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (
            ours(tokens(seq_len=cfg.trainer.seq_len)) - theirs(tokens(seq_len=cfg.trainer.seq_len)).logits
        ).abs().max() <= TOL
    args = {"run.storage": cfg.run.storage, "run.name": name, "prompt": "def ", "temperature": 0.0, "top_k": 0}
    text = generate(args | {"max_new_tokens": 16, "device": "cpu", "seed": 0, "step": None})
    tokenizer = run_tokenizer(cfg)
    prompt = torch.tensor([tokenizer.encode("def ")])
    reference = theirs.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert text == tokenizer.decode(reference[0].tolist())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero3", "ps"])  # the workers load the weights; the parameter server does
def test_init_from_trains_from_the_imported_weights(strategy: str, ray_cluster, tmp_path: Path):
    """The first step's loss, before any update, is transformers' loss on that batch."""
    reference = save_hf_model("llama_gqa", tmp_path / "hf")
    cfg = make_config(
        tmp_path, "run.name=imported", f"model.init_from={tmp_path / 'hf'}", "cluster.num_workers=2",
        f"strategy={strategy}", "trainer.max_steps=1",
    )  # fmt: skip
    assert train(cfg)["status"] == "completed"
    cfg = resolve_init_from(cfg, say=lambda line: None)
    x, y = run_batches(cfg)[0].get(1)
    with torch.no_grad():
        want = F.cross_entropy(reference(x).logits.flatten(0, 1), y.flatten()).item()
    assert logged(cfg)[1] == pytest.approx(want, abs=TOL)


@pytest.mark.timeout(300)
def test_resume_loads_the_checkpoint_not_the_imported_weights(ray_cluster, tmp_path: Path):
    save_hf_model("llama_tied", tmp_path / "hf")
    common = (f"model.init_from={tmp_path / 'hf'}", "cluster.num_workers=2", "optim.decay_steps=4")

    def run(name: str, steps: int) -> dict[int, float]:
        cfg = make_config(tmp_path, f"run.name={name}", f"trainer.max_steps={steps}", *common)
        assert train(cfg)["status"] == "completed"
        return logged(cfg)

    straight = run("straight", 4)
    run("resumed", 2)
    assert run("resumed", 4)[4] == pytest.approx(straight[4], abs=1e-6)


@pytest.mark.timeout(300)
def test_bpe_run_exports_its_tokenizer(ray_cluster, tmp_path: Path):
    """A run on BPE shards: the exported tokenizer encodes as the run's, ids above 255 and the
    end-of-text token included, and the model's vocabulary is the run's."""
    from distrain.commands.export import export
    from distrain.data.corpus import stdlib_files
    from distrain.data.prepare import prepare
    from distrain.driver.cli import compose

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, f in enumerate(stdlib_files()[10:20]):
        (corpus / f"{i:02d}.py").write_bytes(Path(f).read_bytes())
    shards = tmp_path / "shards"
    prepare(
        compose([f"data.path={corpus}", "tokenizer=bpe", "tokenizer.vocab_size=320", f"data.shards={shards}"]), shards
    )
    cfg = make_config(
        tmp_path, "run.name=bpe", f"data.shards={shards}", "tokenizer=bpe", "model.vocab_size=320",
        "model=gpt2_nano", "cluster.num_workers=2", "strategy=tp", "trainer.max_steps=2",
    )  # fmt: skip
    assert train(cfg)["status"] == "completed"
    out, _ = export(cfg.run_dir, tmp_path / "export")
    ours, theirs = run_tokenizer(cfg), transformers.AutoTokenizer.from_pretrained(out)
    text = "def main(argv):\n    return sorted(argv)<|endoftext|>"
    ids = ours.encode(text)
    assert theirs.encode(text) == ids and max(ids) > 255 and ids[-1] == ours.eos_id == theirs.eos_token_id
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.vocab_size == 320 and model.config.eos_token_id == ours.eos_id
    _, trained = load_trained(cfg.run_dir)
    with torch.no_grad():
        x = torch.tensor([ids])
        assert (trained(x) - model(x).logits).abs().max() <= TOL


def test_a_model_transformers_cannot_hold_is_refused_by_name():
    """Export refuses before writing: grouped-query attention in a GPT-2 (Hugging Face's has none), a router
    Mixtral's cannot compute, a shared expert Qwen3-MoE lacks, per-head norms in a GPT-2, and a model of the user's
    own, which has no Hugging Face class at all."""
    from distrain.config import ModelConfig, MoEConfig

    shape = dict(dim=64, n_layers=1, n_heads=4, ffn_dim=128, vocab_size=256, n_positions=64)
    gqa = ModelConfig(_target_="distrain.model.gpt2.GPT2", name="g", n_kv_heads=2, **shape)
    with pytest.raises(ConfigError, match="model.n_kv_heads=2: Hugging Face's GPT-2 has no grouped-query attention"):
        hf_config(gqa, 64)
    sigmoid = ModelConfig(
        _target_="distrain.model.moe.MoETransformer", name="m", moe=MoEConfig(4, score="sigmoid"), **shape
    )
    with pytest.raises(ConfigError, match="model.moe.score=sigmoid: Mixtral's router is a softmax"):
        hf_config(sigmoid, 64)
    shared = ModelConfig(
        _target_="distrain.model.moe.MoETransformer", name="q", qk_norm=True, moe=MoEConfig(4, shared_experts=1),
        **shape,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="model.moe.shared_experts=1: Qwen3-MoE has no shared expert"):
        hf_config(shared, 64)
    qk_norm = ModelConfig(_target_="distrain.model.gpt2.GPT2", name="g", qk_norm=True, **shape)
    with pytest.raises(ConfigError, match="distrain.model.gpt2.GPT2 has no Hugging Face counterpart with model.qk_n"):
        hf_config(qk_norm, 64)
    own = ModelConfig(_target_="dropout_model.DropoutLlama", name="d", **shape)
    with pytest.raises(ConfigError, match="model._target_=dropout_model.DropoutLlama has no Hugging Face counterpart"):
        hf_config(own, 64)
