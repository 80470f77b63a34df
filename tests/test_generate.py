"""jobs/generate.py on a run trained under pipeline parallelism: greedy decoding equals transformers'
`generate` on the exported model (an independent reference), sampling is reproducible by seed, and bad
input gets one line and exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, make_config

from distrain.data.tokenizer import run_tokenizer
from distrain.driver.launch import train
from distrain.driver.trained import load_trained

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(REPO / "jobs"))
from export import export  # noqa: E402
from generate import sample  # noqa: E402

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
    model = transformers.AutoModelForCausalLM.from_pretrained(export(run.run_dir, tmp_path / "hf")).eval()
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
