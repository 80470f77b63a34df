"""A URL is never a path (issue 43): text that starts like a URL (`s3:/runs/team`) but is not a well-formed one is
refused in one line by every job that takes a storage or an output (train, its sweeps, prepare_data, export,
generate, plot), exit status 2, before anything starts and with nothing written: no local `s3:` folder. No store
and no Ray needed."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, make_config

from distrain.config import ConfigError, StorageConfig
from distrain.driver.jobargs import boolean, job_args
from distrain.driver.validation import validate
from distrain.storage.publish import staged
from distrain.urls import check_location

FIX = "is not a well-formed URL: write s3://runs/team (scheme://bucket/prefix), or ./s3:/runs/team for a local"


def job(name: str):
    """The job `name` (distrain/commands/<name>.py, which jobs/<name>.py calls), its `main` to call in this process."""
    return importlib.import_module(f"distrain.commands.{name}")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("s3:/runs/team", "write s3://runs/team "),
        ("s3:runs/team", "write s3://runs/team "),
        ("s3:///runs/team", "write s3://runs/team "),  # no bucket
        ("s3://", "write s3://BUCKET/PREFIX "),
        ("file:/tmp/runs", "write file:///tmp/runs "),
        ("nosuch://bucket/runs", "no filesystem for nosuch:// is installed"),
    ],
)
def test_text_that_starts_like_a_url_is_refused_unless_well_formed(text: str, says: str):
    with pytest.raises(ValueError) as refused:
        check_location(text, "run.storage")
    line = str(refused.value)
    assert line.startswith(f"run.storage={text!r}") and says in line and "\n" not in line, line


@pytest.mark.parametrize("text", ["s3://runs/team", "file:///tmp/runs", "runs", "/abs/runs", "./s3:/runs", "C:x"])
def test_a_well_formed_url_or_a_path_passes(text: str):
    check_location(text, "run.storage")


def test_train_refuses_it_before_anything_starts_or_is_written(tmp_path: Path):
    """The command as a user types it; nothing made where it ran."""
    done = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "train.py"), "run.storage=s3:/runs/team", "run.name=r"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    line = f"distrain: error: run.storage='s3:/runs/team' {FIX} folder of that name\n"
    assert done.returncode == 2 and done.stderr == line, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_validation_refuses_it_for_every_place_a_run_takes(tmp_path: Path):
    """run.storage and data.shards (a sweep's every point is validated so), and a cache folder that is a URL."""
    for key, value, says in [
        ("run.storage", "s3:/runs/team", FIX),
        ("data.shards", "s3:/runs/team", FIX),
        ("storage.cache_dir", "s3://runs/cache", "is a URL: it is each node's own local folder"),
    ]:
        with pytest.raises(ConfigError, match="^" + key) as refused:
            validate(make_config(tmp_path, f"{key}={value}"))
        assert says in str(refused.value)


def test_a_sweep_refuses_it_before_hydra_makes_its_folder(tmp_path: Path, monkeypatch):
    """A sampling sweeper's points are validated only as they come: the sweep's own check refuses it first."""
    monkeypatch.chdir(tmp_path)
    train = job("train")
    with pytest.raises(train.BadInput, match=re.escape(f"run.storage='s3:/runs/team' {FIX}")):
        train.check_sweep_storage(["hydra/sweeper=optuna", "run.storage=runs,s3:/runs/team"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("name", "args", "key"),
    [
        ("prepare_data", ["data.shards=s3:/runs/team"], "data.shards"),
        ("export", ["run.name=r", "run.storage=s3:/runs/team", "out=hf"], "run.storage"),
        ("export", ["run.name=r", "out=s3:/runs/team"], "out"),
        ("generate", ["run.name=r", "run.storage=s3:/runs/team", "prompt=x"], "run.storage"),
        ("plot", ["run.name=r", "run.storage=s3:/runs/team"], "run.storage"),
        ("plot", ["run.name=r,s3:/runs/team"], "run.name"),
    ],
)
def test_every_job_refuses_it_in_one_line(name: str, args: list[str], key: str, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        job(name).main(args)
    out, err = capsys.readouterr()
    line = f"distrain: error: {key}='s3:/runs/team' {FIX} folder of that name\n"
    assert exited.value.code == 2 and out == "" and err == line, err
    assert list(tmp_path.iterdir()) == []


def test_an_output_to_a_url_checks_it_where_it_is_written(tmp_path: Path):
    """publish.staged, which export_to (a Python caller's, no job argument checked) and prepare_data write through."""
    with pytest.raises(ConfigError, match=re.escape(f"out='s3:/runs/team' {FIX}")):
        with staged("s3:/runs/team", StorageConfig(cache_dir=str(tmp_path)), ("config.json",), "out"):
            pass
    assert list(tmp_path.iterdir()) == []


def test_plot_writes_a_local_file_only(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        job("plot").main(["run.name=r", "out=s3://runs/team/r.png"])
    assert exited.value.code == 2 and "out='s3://runs/team/r.png': the picture is written to a local file" in (
        capsys.readouterr().err
    )
    assert list(tmp_path.iterdir()) == []


def test_a_flag_of_a_job_is_true_or_false():
    """export's storage.create_bucket: `bool('false')` would be True."""
    flags = {"storage.create_bucket": (boolean, False)}
    assert job_args(["storage.create_bucket=false"], flags, "u") == {"storage.create_bucket": False}
    assert job_args(["storage.create_bucket=True"], flags, "u") == {"storage.create_bucket": True}
    with pytest.raises(ConfigError, match="storage.create_bucket='yes': expected boolean"):
        job_args(["storage.create_bucket=yes"], flags, "u")
