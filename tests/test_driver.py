"""The driver's checks before any worker starts, and the pieces they rest on."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_config

from distrain.config import ConfigError, OptimConfig, to_plain
from distrain.driver.launch import resolved, train
from distrain.driver.rerun import check_resumable
from distrain.driver.validation import validate
from distrain.driver.workers import group_spec
from distrain.storage.fsutil import LockedError, exclusive_lock
from distrain.train.optim import lr_at


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, decay_steps=None)
    assert [lr_at(s, cfg, 100) for s in (0, 5, 10)] == [0.0, 0.5, 1.0]
    decay = [lr_at(s, cfg, 100) for s in range(10, 101)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))
    assert lr_at(55, cfg, 100) == pytest.approx(0.55)  # halfway down the cosine: (1 + 0.1) / 2
    assert lr_at(100, cfg, 100) == pytest.approx(0.1) and lr_at(150, cfg, 100) == pytest.approx(0.1)
    # decay_steps fixes the schedule's length, whatever max_steps this invocation stops at.
    longer = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, decay_steps=200)
    assert lr_at(50, longer, 50) == lr_at(50, longer, 200) > lr_at(50, cfg, 50)


def test_lock_refuses_a_second_writer_and_takes_over_a_dead_ones(tmp_path: Path):
    lock = tmp_path / ".lock"
    with exclusive_lock(lock):
        with pytest.raises(LockedError, match=f"pid {os.getpid()}"), exclusive_lock(lock):
            pass
    assert not lock.exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(json.dumps({"host": os.uname().nodename, "pid": int(dead.stdout)}))
    with exclusive_lock(lock):
        assert json.loads(lock.read_text())["pid"] == os.getpid()


def test_resume_refuses_another_model_and_warns_about_other_data(tmp_path: Path):
    saved = to_plain(make_config(tmp_path, "run.name=r"))
    check_resumable(saved, saved)
    with pytest.raises(ConfigError, match=r"model\.dim=32, this config has 64"):
        check_resumable(saved, to_plain(make_config(tmp_path, "run.name=r", "model.dim=64")))
    with pytest.warns(UserWarning, match=r"trainer\.seed=7"):
        check_resumable(saved, to_plain(make_config(tmp_path, "run.name=r", "trainer.seed=7")))


def test_a_checkpoints_config_is_what_a_resume_compares(tmp_path: Path):
    """Rank 0 records the config it trains (checkpoint meta, W&B) as dataclasses.asdict gives it, no OmegaConf on
    its way to the first step; a resume compares that record with the driver's to_plain: one dict, to the type."""
    cfg, _ = resolved(make_config(tmp_path, "strategy=fsdp_tp", "cluster.num_workers=4", "+cluster.env_vars.A=b"))
    recorded = dataclasses.asdict(cfg)
    assert recorded == to_plain(cfg) and json.dumps(recorded) == json.dumps(to_plain(cfg))


def test_relative_storage_is_refused_on_an_existing_cluster(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # never reached: the check comes first
    cfg = make_config(tmp_path, "run.name=r")
    cfg.run.storage = "runs"
    with pytest.raises(ConfigError, match="run.storage='runs' is relative"):
        train(cfg)


def test_workers_get_the_users_wandb_settings(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_ENTITY", "team")
    cfg = make_config(tmp_path, "run.name=r")
    env = dict(group_spec(cfg, validate(cfg)).env)
    assert env["WANDB_API_KEY"] == "k" * 40 and env["WANDB_ENTITY"] == "team"


def test_only_a_stop_before_anything_happened_empties_a_new_run_directory(tmp_path: Path):
    """A stop before the first step (StoppedBeforeStart) leaves no new run directory behind but its lock; any other
    interrupt (a second Ctrl-C while a run that trained writes its record) and a run holding checkpoints keep it all."""
    from distrain.driver.rerun import leaving_nothing
    from distrain.driver.stop import Stopped, StoppedBeforeStart

    cases = ((StoppedBeforeStart(2), False, True), (Stopped(2), False, False), (KeyboardInterrupt(), False, False))
    for raised, checkpoints, emptied in (*cases, (StoppedBeforeStart(2), True, False)):
        run = tmp_path / f"{type(raised).__name__}-{checkpoints}"
        (run / "logs").mkdir(parents=True)
        for name in (".lock", "metrics.jsonl", "logs/driver-1.log", *(["checkpoints/x"] * checkpoints)):
            (run / name).parent.mkdir(exist_ok=True)
            (run / name).write_text("1")
        before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
        with pytest.raises(type(raised)), leaving_nothing(run, ".lock"):
            raise raised
        after = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
        assert after == ([".lock"] if emptied else before), (raised, checkpoints)


def test_a_stop_leaves_a_record_once_a_step_was_trained_or_an_attempt_failed():
    from types import SimpleNamespace

    from distrain.cluster.attempt import Outcome
    from distrain.cluster.history import nothing_happened

    def attempt(progressed: bool, outcome: Outcome) -> SimpleNamespace:
        return SimpleNamespace(progressed=progressed, outcome=outcome)

    assert nothing_happened([attempt(False, Outcome.STOPPED)])
    assert not nothing_happened([attempt(True, Outcome.STOPPED)])
    assert not nothing_happened([attempt(False, Outcome.FAILED), attempt(False, Outcome.STOPPED)])
    assert not nothing_happened([attempt(False, Outcome.HUNG), attempt(False, Outcome.RUNNING)])
