"""Bad input: a one-line error naming the key and the fix, a non-zero exit, and no actor started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, make_config

from distrain.config import ConfigError, validate


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["cluster.num_workers=0"], "cluster.num_workers"),
        (
            ["cluster.num_workers=2", "trainer.global_batch_size=12", "trainer.micro_batch_size=4"],
            "trainer.global_batch_size",
        ),
        (["data.path=/nonexistent/corpus"], "data.path"),
        (["strategy.tp=2"], "strategy.tp"),
        (["strategy.dp_replicate=3", "cluster.num_workers=2"], "strategy.dp_replicate"),
        (["model.n_heads=3"], "model.dim"),
        (["optim.name=lion"], "optim.name"),
        (["checkpoint.keep=0"], "checkpoint.keep"),
        (["logger.wandb.mode=sometimes"], "logger.wandb.mode"),
    ],
)
def test_validate_names_the_key(tmp_path: Path, overrides: list[str], key: str):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        validate(make_config(tmp_path, "run.name=bad", *overrides))
    assert "\n" not in str(err.value)


def test_defaults_are_valid(tmp_path: Path):
    validate(make_config(tmp_path, "run.name=ok"))


def run_cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, str(REPO / "jobs" / "train.py"), f"run.storage={tmp_path}", "run.name=bad", *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["model=gpt5"], "unknown model 'gpt5'"),
        (["strategy=magic"], "unknown strategy 'magic'"),
        (["cluster.num_workers=0"], "cluster.num_workers=0"),
        (["trainer.global_batch_size=30"], "trainer.global_batch_size=30"),
        (["data.path=/nonexistent/corpus"], "data.path='/nonexistent/corpus'"),
        # The embedded cluster has 2 CPUs: 9 workers × 0.25 CPU, or 3 × 1 CPU, can never be placed.
        (
            ["cluster.num_workers=3", "cluster.cpus_per_worker=1", "trainer.global_batch_size=24"],
            "cluster.num_workers=3 needs 3 CPU",
        ),
    ],
)
def test_cli_bad_input_fails_early_with_one_line(tmp_path: Path, overrides: list[str], needle: str):
    result = run_cli(tmp_path, *overrides)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("distrain: error:")]
    assert len(errors) == 1 and needle in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    run_dir = tmp_path / "bad"
    assert not (run_dir / "placement.json").exists()  # no worker was ever placed
    assert not (run_dir / "checkpoints").exists()


def test_cfg_job_prints_the_composed_config(tmp_path: Path):
    result = run_cli(tmp_path, "model=gpt2_124m", "--cfg", "job")
    assert result.returncode == 0, result.stderr
    assert "dim: 768" in result.stdout and "name: ddp" in result.stdout
