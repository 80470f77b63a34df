"""Hydra's own sweepers: every sweep its grammar has passes the up-front check, and Optuna's sweeper
optimises what the points return (their final validation loss), a point it samples twice included."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from conftest import REPO, TINY, in_background, make_config, when
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from distrain.commands import train as entrypoint  # noqa: E402  (jobs/train.py, distrain train)
from distrain.config import ConfigError
from distrain.driver.cli import CONF_DIR, BadInput, check_overrides, register
from distrain.driver.sweep import PointComposer, objective
from distrain.driver.validation import validate


@pytest.mark.parametrize(
    "override",
    [
        "optim.lr=interval(0.0005,0.005)",
        "optim.lr=tag(log,interval(0.0005,0.005))",
        "trainer.max_steps=int(interval(2,8))",
        "trainer.max_steps=range(2,8,2)",
        "optim.lr=choice(0.001,0.003)",
        "strategy=glob(zero*)",
        "strategy=glob(*,exclude=[ps,3d])",
    ],
)
def test_every_sweep_of_hydras_grammar_passes_the_check(override: str):
    check_overrides([override])


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("optim.lr=interval(0.005,0.0005)", "an interval's start must be below its end"),
        ("trainer.max_steps=interval(2,8)", "takes int, not 2.0; int(interval(a,b)) samples integers"),
        ("optim.lr=interval(fast,0.5)", "Error parsing override 'optim.lr=interval(fast,0.5)'"),
        ("optim.lrr=interval(0.1,0.5)", "unknown key optim.lrr; did you mean optim.lr?"),
        ("strategy=glob(nope*)", "matches none of strategy's options"),
        ("optim.lr=glob(*)", "glob() sweeps the options of a config group, and optim.lr is none"),
    ],
)
def test_a_sweep_that_cannot_work_is_refused_in_one_line(override: str, needle: str):
    with pytest.raises(BadInput) as refused:
        check_overrides([override])
    assert needle in str(refused.value)


def test_a_point_returns_none_unless_it_completed_with_a_finite_objective():
    completed = {"status": "completed", "final_loss": 2.5, "final_val_loss": 2.25}
    assert objective(completed, "val_loss") == 2.25 and objective(completed, "loss") == 2.5
    for summary in (None, {**completed, "status": "failed"}, {**completed, "final_val_loss": float("nan")}):
        assert objective(summary, "val_loss") is None


@pytest.mark.timeout(300)
def test_optunas_sweeper_gets_each_points_final_val_loss(tmp_path: Path, ray_cluster, monkeypatch, capsys):
    """Three trials of a choice of two: one point is sampled twice, and gets its run's result again."""
    studies = []
    create_study = optuna.create_study
    monkeypatch.setattr(optuna, "create_study", lambda **kw: studies.append(create_study(**kw)) or studies[-1])
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    argv = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=1"]
    argv += ["optim.lr=choice(0.001,0.003)", *TINY, "trainer.max_steps=3", f"run.storage={tmp_path}", "run.name=o"]
    try:
        assert entrypoint.entry(argv) == 0, capsys.readouterr()
    finally:
        GlobalHydra.instance().clear()
    (study,) = studies
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 3
    runs = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("o-"))
    assert runs == ["o-optim.lr_0.001", "o-optim.lr_0.003"]  # the repeated point trained once
    for trial in study.trials:
        summary = json.loads((tmp_path / f"o-optim.lr_{trial.params['optim.lr']}" / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["final_step"] == 3
        assert trial.value == summary["final_val_loss"]
    (record,) = (tmp_path / "sweeps").glob("*/sweep.json")
    points = json.loads(record.read_text())
    assert sorted(p["status"] for p in points) == ["completed", "completed", "reused"]
    assert [p["objective"] for p in points] == [t.value for t in study.trials]


def test_an_unknown_objective_is_refused(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"run.objective='nope': choose val_loss or loss"):
        validate(make_config(tmp_path, "run.objective=nope"))


@pytest.fixture
def fresh_entrypoint(monkeypatch):
    """distrain train's per-process state, new for each in-process call."""
    monkeypatch.setattr(entrypoint, "SWEEP", {"keys": set(), "points": [], "dir": None, "planned": []})
    monkeypatch.setattr(entrypoint, "CURRENT", {})
    monkeypatch.setattr(sys, "argv", sys.argv[:1])


@pytest.mark.parametrize(
    ("sweep", "point"),
    [
        ("trainer.global_batch_size=8,30", "#2 of 4 (trainer.global_batch_size=30 optim.lr=0.001)"),
        ("trainer.global_batch_size=choice(8,16,30)", "#4 of 6 (trainer.global_batch_size=30 optim.lr=0.001)"),
        ("trainer.global_batch_size=range(8,40,22)", "#2 of 4 (trainer.global_batch_size=30 optim.lr=0.001)"),
        ("strategy=glob([ddp,3d])", "#0 of 4 (strategy=3d optim.lr=0.001)"),  # 3d needs 4 workers, not 2
    ],
)
@pytest.mark.usefixtures("fresh_entrypoint")
def test_a_sweep_with_an_impossible_point_is_refused_before_any_trains(tmp_path: Path, capsys, sweep: str, point: str):
    argv = ["-m", *TINY, sweep, "optim.lr=0.001,0.003", "trainer.max_steps=3", f"run.storage={tmp_path}", "run.name=s"]
    assert entrypoint.entry(argv) == 2
    said = capsys.readouterr()
    (error,) = said.err.splitlines()
    assert error.startswith(f"distrain: error: sweep point {point} cannot run: ") and "nothing was trained" in error
    assert "Launching" not in said.out + said.err and list(tmp_path.iterdir()) == []  # nothing trained, nothing made


def sweep_runs(tmp_path: Path, *overrides: str) -> dict[str, dict]:
    """A sweep of one-step points in this process; each run directory's summary, by name."""
    argv = ["-m", *TINY, "trainer.max_steps=1", f"run.storage={tmp_path}", *overrides]
    try:
        assert entrypoint.entry(argv) == 0
    finally:
        GlobalHydra.instance().clear()
    return {p.name: json.loads((p / "summary.json").read_text()) for p in tmp_path.iterdir() if p.name != "sweeps"}


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("ray_cluster", "fresh_entrypoint")
def test_a_sweep_over_run_name_trains_a_run_of_each_name(tmp_path: Path):
    runs = sweep_runs(tmp_path, "run.name=first,second")
    assert sorted(runs) == ["first", "second"]
    assert all(s["status"] == "completed" and s["final_step"] == 1 for s in runs.values()), runs


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("ray_cluster", "fresh_entrypoint")
def test_a_sweep_without_run_name_names_its_points_from_one_start(tmp_path: Path):
    """The default name's timestamp is the sweep's, not each point's: its points' names differ only by
    their values, and each is a run of its own (none extends another)."""
    runs = sweep_runs(tmp_path, "optim.lr=0.001,0.003")
    stamps = {re.fullmatch(r"nano-ddp-(\d{8}-\d{6})-optim.lr_0.00[13]", name)[1] for name in runs}
    assert len(runs) == 2 and len(stamps) == 1, sorted(runs)
    assert all(s["status"] == "completed" and s["final_step"] == 1 for s in runs.values()), runs


def test_points_compose_as_hydra_composes_them(tmp_path: Path):
    """The fast path of the up-front check (one defaults list per set of group choices) gives Hydra's config."""
    from hydra import compose, initialize_config_dir

    points = [
        ["model=nano", "optim.lr=0.003", "+cluster.env_vars.X=1", f"run.storage={tmp_path}"],
        ["strategy=zero3", "++trainer.max_steps=7", "run.name=${model.name}-x"],
        ["strategy=zero3", "trainer.global_batch_size=16", "checkpoint.async_save=true"],
    ]
    with PointComposer() as composer:
        fast = [OmegaConf.to_container(composer.compose(p)) for p in points]
    register()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        assert fast == [OmegaConf.to_container(compose("train", overrides=p)) for p in points]
    assert fast[1]["trainer"]["max_steps"] == 7 and fast[2]["strategy"]["name"] == "zero3"


@pytest.mark.usefixtures("fresh_entrypoint")
def test_a_sampled_point_is_refused_when_it_comes_and_names_no_directory(tmp_path: Path, capsys):
    """Optuna's points are not known up front: its refused point is recorded, with no run directory."""
    tiny = [o for o in TINY if not o.startswith("trainer.global_batch_size=")]
    argv = ["-m", *tiny, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=1", "trainer.global_batch_size=choice(30,31)"]
    argv += ["trainer.max_steps=3", f"run.storage={tmp_path}", "run.name=o"]
    try:
        with pytest.raises(SystemExit):  # Optuna: "No trials are completed yet"
            entrypoint.entry(argv)
    finally:
        GlobalHydra.instance().clear()
    table = capsys.readouterr().out
    assert re.search(r"\n0 +trainer.global_batch_size=3[01] +refused +- +- +-\n", table), table
    (record,) = (tmp_path / "sweeps").glob("*/sweep.json")
    ((point,),) = [json.loads(record.read_text())]
    assert point["status"] == "refused" and point["run_dir"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweeps"]


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("ray_cluster", "fresh_entrypoint")
def test_a_sweep_stopped_midway_lists_the_points_it_never_ran(tmp_path: Path, capsys):
    """SIGTERM (`ray job stop`) while the first of three points starts, its ranks held before their first step:
    that point stops at once and leaves no directory, the others never run, and the table (and sweep.json) list
    all three."""
    hold = tmp_path / "hold"
    hold.touch()
    first = tmp_path / "s-optim.lr_0.001"

    def stop_the_first() -> None:
        when((first / "placement.json").exists)  # the ranks' calls went out
        os.kill(os.getpid(), signal.SIGTERM)

    argv = ["-m", *TINY, "optim.lr=0.001,0.002,0.003", "trainer.max_steps=3", f"fault.hold_file={hold}"]
    stopper = in_background(stop_the_first)
    try:
        assert entrypoint.entry([*argv, f"run.storage={tmp_path}", "run.name=s"]) == 143
    finally:
        GlobalHydra.instance().clear()
    stopper.join(10)
    assert not stopper.errors, stopper.errors
    out = capsys.readouterr()
    assert "stopped by SIGTERM: run 's-optim.lr_0.001' has trained nothing (exit status 143)" in out.err
    table = out.out[out.out.index("distrain: sweep of 3 points") :]
    assert re.search(r"\n0 +optim.lr=0.001 +stopped +- +- +-\n", table), table
    assert re.search(r"\n1 +optim.lr=0.002 +not run +- +- +-\n2 +optim.lr=0.003 +not run +- +- +-", table), table
    (record,) = (tmp_path / "sweeps").glob("*/sweep.json")
    assert [p["status"] for p in json.loads(record.read_text())] == ["stopped", "not run", "not run"]
    assert sorted(p.name for p in tmp_path.iterdir() if ".held." not in p.name) == ["hold", "sweeps"]


def test_optunas_sweeper_adds_no_lines_of_its_own_start(tmp_path: Path):
    """Optuna imports alembic, whose seven "setup plugin" INFO lines Hydra's logging printed at every sweep. (A
    point refused in one line: nothing trains, no cluster starts.)"""
    tiny = [o for o in TINY if not o.startswith("trainer.global_batch_size=")]
    argv = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=1", "trainer.global_batch_size=choice(30,31)"]
    argv += [*tiny, f"run.storage={tmp_path}", "run.name=o"]
    done = subprocess.run(
        [sys.executable, "jobs/train.py", *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert "[HYDRA] Launching 1 jobs locally" in done.stdout, done.stdout + done.stderr  # Hydra's logging is on
    assert "setup plugin" not in done.stdout + done.stderr
