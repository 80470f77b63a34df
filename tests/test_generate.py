"""jobs/generate.py on a run trained under pipeline parallelism: greedy decoding equals transformers'
`generate` on the exported model (an independent reference), sampling is reproducible by seed, and bad
input gets one line and exit status 2. jobs/export.py and jobs/generate.py past a damaged checkpoint."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import DAMAGES, REPO, damage, make_config
from torch import nn

from distrain.data.tokenizer import run_tokenizer
from distrain.driver.launch import train
from distrain.driver.trained import load_trained
from distrain.storage import checkpoint
from distrain.storage.fsutil import write_json

transformers = pytest.importorskip("transformers")
from distrain.commands import export as export_job  # noqa: E402
from distrain.commands import generate as generate_job  # noqa: E402
from distrain.commands.export import export  # noqa: E402
from distrain.commands.generate import sample  # noqa: E402

PROMPT = "def "


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    storage = tmp_path_factory.mktemp("runs")
    cfg = make_config(storage, "run.name=gen", "cluster.num_workers=2", "strategy=pp", "trainer.max_steps=20")
    assert train(cfg)["status"] == "completed"
    return cfg


@pytest.mark.timeout(300)
def test_greedy_equals_transformers_generate(run, tmp_path: Path):
    command = [sys.executable, "jobs/generate.py", f"run.storage={run.run.storage}", "run.name=gen", f"prompt={PROMPT}"]
    result = subprocess.run(
        [*command, "temperature=0", "max_new_tokens=24", "device=cpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    tokenizer = run_tokenizer(run)
    model = transformers.AutoModelForCausalLM.from_pretrained(export(run.run_dir, tmp_path / "hf")[0]).eval()
    prompt = torch.tensor([tokenizer.encode(PROMPT)])
    reference = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert result.stdout == tokenizer.decode(reference[0].tolist()) + "\n"
    assert len(set(result.stdout[len(PROMPT) :])) > 1, result.stdout  # trained: not one token repeated


def test_sampling_is_seeded_and_top_k_1_is_greedy(run):
    cfg, model = load_trained(run.run_dir)
    ids = run_tokenizer(cfg).encode(PROMPT)
    context = cfg.trainer.seq_len

    def draw(seed: int, top_k: int = 0) -> list[int]:
        return sample(model, ids, 40, context, 1.0, top_k, torch.Generator().manual_seed(seed))

    assert draw(0) == draw(0) and draw(0) != draw(1)
    assert draw(0, top_k=1) == sample(model, ids, 40, context)
    assert len(sample(model, ids, 40, context)) == len(ids) + 40  # beyond trainer.seq_len: the window slides


class Fixed(nn.Module):
    """Logits that do not depend on the tokens: every draw is from one known distribution."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = nn.Parameter(logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(*x.shape, -1)


class Counting(nn.Module):
    """Greedy picks (the window's first token + its length) mod 256; like a model, it has positions for
    `context` tokens only."""

    def __init__(self, context: int):
        super().__init__()
        self.context, self.weight = context, nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.shape[1] <= self.context, f"{x.shape[1]} tokens, more than the model's {self.context} positions"
        return F.one_hot((x[:, :1] + x.shape[1]) % 256, 256).float().expand(*x.shape, -1)


def test_past_the_context_the_window_slides():
    """A prompt longer than the context and a continuation of three windows: each token comes from the last
    `context` tokens."""
    context, ids = 8, list(range(100, 111))
    want = list(ids)
    for _ in range(3 * context):
        want.append((want[-context] + context) % 256)
    assert sample(Counting(context), ids, 3 * context, context) == want


@pytest.mark.parametrize(("temperature", "top_k"), [(0.5, 0), (2.0, 0), (0.7, 3), (1.5, 5)])
def test_sampling_draws_from_the_tempered_top_k_distribution(temperature: float, top_k: int):
    """4000 draws: each token's frequency within 0.03 of softmax(logits / temperature) over the top_k
    tokens (±4 standard deviations at most), and no token outside them."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -2.0])
    draws = sample(Fixed(logits), [0], 4000, 8, temperature, top_k, torch.Generator().manual_seed(0))[1:]
    kept = logits.topk(top_k or len(logits)).indices
    want = torch.zeros_like(logits)
    want[kept] = (logits[kept] / temperature).softmax(-1)
    got = torch.bincount(torch.tensor(draws), minlength=len(logits)) / len(draws)
    assert (got - want).abs().max() < 0.03, (got, want)
    assert got[want == 0].sum() == 0


def test_generation_ends_at_the_end_of_text_token(run, monkeypatch, capsys):
    """A tokenizer whose end-of-text token is the first one greedy decoding picks: the continuation is that
    token alone (the run's byte tokenizer has none, so the run's tokenizer is given one here)."""
    from distrain.data import tokenizer as tokenizers

    cfg, model = load_trained(run.run_dir)
    ids = run_tokenizer(cfg).encode(PROMPT)
    first = sample(model, ids, 1, cfg.trainer.seq_len)[-1]
    assert sample(model, ids, 20, cfg.trainer.seq_len, stop=first) == [*ids, first]

    def with_eos(cfg):
        tokenizer = run_tokenizer(cfg)
        tokenizer.eos_id = first
        return tokenizer

    monkeypatch.setattr(tokenizers, "run_tokenizer", with_eos)
    generate_job.main([f"run.storage={run.run.storage}", "run.name=gen", f"prompt={PROMPT}", "temperature=0"])
    assert capsys.readouterr().out == with_eos(cfg).decode([*ids, first]) + "\n"


@pytest.mark.parametrize(
    ("job", "args", "says"),
    [
        ("generate", ["run.name=nosuchrun", "prompt=x"], "no run at"),
        ("generate", ["run.name=gen", "prompt=x", "step=7"], "no committed checkpoint"),
        ("generate", ["run.name=gen", "prompt=x", "temprature=0"], "did you mean temperature="),
        ("generate", ["run.name=gen", "prompt=x", "top_k=many"], "top_k='many': expected int"),
        ("generate", ["run.name=gen"], "prompt= is required"),
        ("export", ["run.name=nosuchrun", "out=x"], "no run at"),
        ("export", ["run.name=gen", f"out={REPO / 'jobs'}"], "exists and is not empty"),
    ],
)
def test_bad_input_one_line_exit_2(run, job: str, args: list[str], says: str):
    result = subprocess.run(
        [sys.executable, f"jobs/{job}.py", f"run.storage={run.run.storage}", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and says in result.stderr, result.stderr


def with_older_checkpoint(run, tmp_path: Path) -> Path:
    """A copy of the run (its storage returned) with a second, older checkpoint: step 20's files as step 10,
    meta.json's step rewritten, committed as a save commits."""
    storage = tmp_path / "runs"
    shutil.copytree(run.run_dir, storage / "gen")
    root = storage / "gen" / "checkpoints"
    older = checkpoint.step_dir(root, 10)
    shutil.copytree(checkpoint.step_dir(root, 20), older)
    (older / checkpoint.COMMIT_MARKER).unlink()
    write_json(older / checkpoint.META_FILE, checkpoint.read_meta(older) | {"step": 10})
    checkpoint.commit(root, 10, {}, keep=5, reader="the test")
    return storage


@pytest.mark.parametrize("kind", DAMAGES)
def test_export_falls_back_past_a_damaged_checkpoint_and_says_which_step(run, tmp_path: Path, capsys, kind: str):
    storage = with_older_checkpoint(run, tmp_path)
    damage(checkpoint.step_dir(storage / "gen" / "checkpoints", 20), kind)
    capsys.readouterr()
    export_job.main([f"run.storage={storage}", "run.name=gen", f"out={tmp_path / 'hf'}"])
    out, err = capsys.readouterr()
    assert out == f"distrain: exported run gen at step 10 to {tmp_path / 'hf'}\n"
    assert len(err.splitlines()) == 1 and "step_00000020" in err and DAMAGES[kind] in err, err
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_generate_falls_back_and_both_refuse_in_one_line_when_none_verifies(run, tmp_path: Path, capsys):
    storage = with_older_checkpoint(run, tmp_path)
    root = storage / "gen" / "checkpoints"
    damage(checkpoint.step_dir(root, 20), "tensor_bytes")
    args = [f"run.storage={storage}", "run.name=gen"]
    capsys.readouterr()
    generate_job.main([*args, f"prompt={PROMPT}", "max_new_tokens=4", "device=cpu"])
    out, err = capsys.readouterr()
    assert out.startswith(PROMPT) and len(err.splitlines()) == 1 and "step_00000020" in err, (out, err)

    with pytest.raises(SystemExit) as refused:  # the damaged step named
        export_job.main([*args, f"out={tmp_path / 'hf'}", "step=20"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and len(err.splitlines()) == 1 and "whole: [10]" in err, err

    damage(checkpoint.step_dir(root, 10), "meta_garbled")
    before = sorted((p.relative_to(root), p.stat().st_size) for p in root.rglob("*"))
    for job, extra in ((export_job, f"out={tmp_path / 'hf'}"), (generate_job, f"prompt={PROMPT}")):
        with pytest.raises(SystemExit) as refused:
            job.main([*args, extra])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and len(err.splitlines()) == 1 and "verifies" in err, err
    assert sorted((p.relative_to(root), p.stat().st_size) for p in root.rglob("*")) == before
    assert not (tmp_path / "hf").exists()


def test_generate_refuses_bad_arguments_in_one_line(run):
    """A negative setting, a device that is none, an empty prompt (after loading: the tokenizer decides), and cuda
    where no GPU is visible: each a one-line ConfigError."""
    from distrain.config import ConfigError

    args = {"run.name": "gen", "run.storage": run.run.storage, "prompt": "x", "max_new_tokens": 1}
    args |= {"temperature": 0.0, "top_k": 0, "seed": 0, "step": None, "device": "cpu"}
    cases = [({"temperature": -1.0}, "must be ≥ 0"), ({"device": "tpu"}, "device='tpu': choose auto, cpu or cuda")]
    cases += [({"prompt": ""}, "prompt= is empty")]
    if not torch.cuda.is_available():
        cases += [({"device": "cuda"}, "device=cuda: no GPU is visible here")]
    for change, says in cases:
        with pytest.raises(ConfigError, match=re.escape(says)):
            generate_job.generate(args | change)
