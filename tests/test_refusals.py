"""A run that cannot be is refused before anything is written or any worker starts: one that cannot fit
in its devices' memory, one the cluster cannot hold, a resume into another model, a run already in use.
And a resume that changes the LR schedule says so."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, make_config

from distrain.cluster.runtime import CapacityError, smallest_mib
from distrain.config import ConfigError
from distrain.driver.fits import check_fits, needed, refusal
from distrain.driver.launch import LOCK_FILE, check_steps_left, train
from distrain.driver.plan import worker_memory
from distrain.driver.validation import validate
from distrain.storage.fsutil import LockedError

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


def test_refused_reruns_write_nothing_and_a_shorter_one_says_its_schedule_changes(tmp_path: Path, ray_cluster):
    """A resume into another model, and a run already in use, leave its directory as it was (the command line
    writes its Hydra record and console log only through on_run_dir)."""
    train(make_config(tmp_path, "run.name=r", "trainer.max_steps=2"))
    run_dir, before = tmp_path / "r", files(tmp_path)
    opened: list[Path] = []
    with pytest.raises(ConfigError, match="was trained with model.dim=32, this config has 64"):
        train(make_config(tmp_path, "run.name=r", "trainer.max_steps=4", "model.dim=64"), on_run_dir=opened.append)
    (run_dir / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid()}))
    with pytest.raises(LockedError, match="is in use by pid"):
        train(make_config(tmp_path, "run.name=r", "trainer.max_steps=4"), on_run_dir=opened.append)
    (run_dir / LOCK_FILE).unlink()
    assert opened == [] and files(tmp_path) == before

    said: list[str] = []
    meta = {"step": 4, "config": {"trainer": {"max_steps": 10}}}
    check_steps_left(meta, make_config(tmp_path, "run.name=r", "trainer.max_steps=6"), said.append)
    assert said == [
        "shortening run 'r' from trainer.max_steps=10 to 6, from step 4: the LR schedule shrinks to the new "
        "length (set optim.decay_steps=10 to keep it)"
    ]


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
