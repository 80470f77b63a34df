"""A run that cannot be is refused before anything is written or any worker starts: one that cannot fit
in its devices' memory, one the cluster cannot hold, a resume into another model, a run already in use.
What the config and the run directory decide is refused before a Ray cluster starts. And a resume that
changes the LR schedule says so."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, make_config

from distrain.cluster.resources import smallest_mib
from distrain.cluster.runtime import CapacityError
from distrain.config import ConfigError
from distrain.driver.fits import check_fits, needed, refusal, verdict
from distrain.driver.launch import train
from distrain.driver.plan import worker_memory
from distrain.driver.rerun import LOCK_FILE, check_steps_left
from distrain.driver.validation import validate

# The tiny model, wider, on long micro-batches: activations of hundreds of GiB per rank, attention scores not counted.
HUGE = ("model.dim=1024", "trainer.seq_len=300000", "trainer.micro_batch_size=8", "trainer.global_batch_size=16")


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_rank_that_cannot_fit_is_refused_with_the_figures_and_knobs(tmp_path: Path):
    cfg = make_config(tmp_path, *HUGE)
    line = str(refusal(cfg, validate(cfg), False, 64 * 2**30, "the largest node has 64.0 GiB"))
    assert "each rank needs an estimated" in line and "GiB" in line and "the largest node has" in line, line
    for knob in ("trainer.micro_batch_size", "trainer.seq_len", "activation_checkpoint", "zero3", "strategy.tp"):
        assert knob in line
    assert "trainer.check_memory=false" in line and "\n" not in line
    cfg = make_config(tmp_path, *HUGE, "trainer.check_memory=false")
    check_fits(cfg, validate(cfg), gpu=False, say=pytest.fail)  # the override: not checked, nothing asked of Ray
    cfg = make_config(tmp_path)
    assert refusal(cfg, validate(cfg), False, 2**30, "1 GiB") is None  # what the tests train fits in 1 GiB


def test_the_memory_check_leaves_out_the_attention_scores(tmp_path: Path):
    """A rank whose blocks fit but whose attention scores would not (the fused kernels never hold them) starts."""
    cfg = make_config(tmp_path, "trainer.seq_len=8192", "trainer.micro_batch_size=2", "trainer.global_batch_size=4")
    layout = validate(cfg)
    without, with_scores = (
        max(needed(mem, False) for mem in worker_memory(cfg, layout, "fp32", scores=scores)) for scores in (False, True)
    )
    assert with_scores > 2 * without  # the scores are most of the estimate that counts them
    assert refusal(cfg, layout, False, (without + with_scores) // 2, "between the two") is None
    assert refusal(cfg, layout, False, without - 1, "a byte short") is not None


def test_the_plan_says_what_the_memory_check_would_do(tmp_path: Path):
    """On this machine's capacity (an embedded cluster's, before it starts): a run that fits passes, one that
    does not would be refused (the refusal's own line), and with the check off it starts whatever."""
    here = {"CPU": 2, "GPU": 0, "memory": 64 * 2**30}
    cfg = make_config(tmp_path)
    said = verdict(cfg, validate(cfg), False, here)
    assert said.startswith("memory check: passes: each rank needs an estimated ") and "64.0 GiB" in said, said
    cfg = make_config(tmp_path, *HUGE)
    said = verdict(cfg, validate(cfg), False, here)
    assert said.startswith("memory check: the run would be refused: each rank needs an estimated "), said
    assert "this machine has 64.0 GiB for workers" in said and "\n" not in said
    cfg = make_config(tmp_path, *HUGE, "trainer.check_memory=false")
    assert verdict(cfg, validate(cfg), False, here).startswith("memory check: off (trainer.check_memory=false)")


def test_nvidia_smi_memory_is_read():
    assert smallest_mib("81559\n40960\n") == 40960
    assert smallest_mib("") is None and smallest_mib("NVIDIA-SMI has failed") is None


@pytest.mark.parametrize(
    ("overrides", "error", "needle"),
    [
        (HUGE, ConfigError, "each rank needs an estimated"),
        (
            ("cluster.num_workers=64", "trainer.global_batch_size=128"),
            CapacityError,
            "cluster.num_workers=64 needs 16 CPU",
        ),
    ],
)
def test_a_run_the_cluster_cannot_hold_creates_nothing(tmp_path: Path, ray_cluster, overrides, error, needle):
    opened: list[Path] = []
    with pytest.raises(error, match=needle):
        train(make_config(tmp_path, "run.name=no", *overrides), on_run_dir=opened.append)
    assert opened == [] and files(tmp_path) == []


def test_a_shorter_rerun_says_its_schedule_changes(tmp_path: Path):
    said: list[str] = []
    meta = {"step": 4, "config": {"trainer": {"max_steps": 10}}}
    check_steps_left(meta, make_config(tmp_path, "run.name=r", "trainer.max_steps=6"), said.append)
    assert said == [
        "shortening run 'r' from trainer.max_steps=10 to 6, from step 4: the LR schedule shrinks to the new "
        "length (set optim.decay_steps=10 to keep it)"
    ]


WITHOUT_RAY = """
import json, sys
import ray
from distrain.driver.cli import compose
from distrain.driver.launch import train

for overrides in json.loads(sys.argv[1]):
    try:
        done = train(compose(overrides))
        said = done["plan"] if "plan" in done else done["status"]
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    print(json.dumps([said, ray.is_initialized()]))
"""


def without_ray(tmp_path: Path, *runs: list[str], env: dict | None = None) -> list[str]:
    """What `train` returned (a plan's text, a run's status) or raised for each of `runs` (overrides over TINY
    and run.storage=tmp_path), one after another in one fresh process that has no Ray cluster and no address
    to attach to, asserting that none had started one by the time it returned."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **(env or {})}
    env.pop("RAY_ADDRESS", None)
    given = json.dumps([[*TINY, f"run.storage={tmp_path}", *run] for run in runs])
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY, given], capture_output=True, text=True, timeout=240, cwd=REPO, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    assert [up for _, up in answers] == [False] * len(runs), answers  # no Ray cluster was started for any
    return [said for said, _ in answers]


@pytest.mark.timeout(400)
def test_what_the_config_and_the_run_directory_decide_is_refused_before_ray_starts(tmp_path: Path, ray_cluster):
    """A finished run rerun (as long, or shorter), a resume into another model, a run another driver holds, a
    learning rate that is no number, a cluster too small and a rank too big for this machine: each refused
    in one line by a driver that started no Ray cluster, the run directory left as it was."""
    train(make_config(tmp_path, "run.name=r", "trainer.max_steps=2"))
    (tmp_path / "held").mkdir()  # another driver's run, alive on this host
    (tmp_path / "held" / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid()}))
    before = files(tmp_path)
    refused = without_ray(
        tmp_path,
        ["run.name=r", "trainer.max_steps=2"],
        ["run.name=r", "trainer.max_steps=1"],
        ["run.name=r", "trainer.max_steps=4", "model.dim=64"],
        ["run.name=held"],
        ["run.name=fresh", "optim.lr=inf"],
        ["run.name=fresh", "cluster.num_workers=64", "trainer.global_batch_size=128", "cluster.local_cpus=2"],
        ["run.name=fresh", *HUGE],
    )
    assert refused[0].startswith("ConfigError: run 'r' has trained 2 steps, so trainer.max_steps=2 leaves")
    assert refused[1].startswith("ConfigError: run 'r' has trained 2 steps, so trainer.max_steps=1 leaves")
    assert "was trained with model.dim=32, this config has 64" in refused[2]
    assert refused[3].startswith(f"LockedError: {tmp_path / 'held'} is in use by pid {os.getppid()}")
    assert refused[4] == "ConfigError: optim.lr=inf: must be a finite number"
    assert refused[5].startswith("CapacityError: cluster.num_workers=64 needs 16 CPU") and "has 2" in refused[5]
    assert "each rank needs an estimated" in refused[6] and "this machine has" in refused[6]
    assert files(tmp_path) == before and all("\n" not in line for line in refused)


GPU_CHECK = """
from distrain.cluster.runtime import connect
from distrain.config import ConfigError
from distrain.driver.cli import compose
from distrain.driver.fits import check_fits
from distrain.driver.validation import validate

connect(None, 1, 1)  # a GPU resource Ray is told of; the fake nvidia-smi on PATH describes it
for overrides in ([], ["model.dim=1024", "trainer.seq_len=300000"]):
    cfg = compose(["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_dim=64", *overrides])
    try:
        check_fits(cfg, validate(cfg), gpu=True, say=print)
        print("fits")
    except ConfigError as e:
        print(e)
"""


@pytest.mark.timeout(120)
def test_gpu_memory_is_asked_of_nvidia_smi_on_the_gpu_nodes(tmp_path: Path):
    """Without a GPU: a cluster told it has one, and an nvidia-smi on PATH reporting two GPUs (80 and 40 GiB),
    as the node's own would; the smallest is the capacity."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nprintf '81920\\n40960\\n'\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-c", GPU_CHECK], capture_output=True, text=True, timeout=110, cwd=REPO, env=env
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and lines[0] == "fits", result.stdout + result.stderr
    assert "each rank needs an estimated" in lines[1] and "the smallest GPU has 40.0 GiB (nvidia-smi on" in lines[1]
