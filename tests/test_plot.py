"""Pictures of a run without an account: jobs/plot.py draws what metrics.jsonl holds (checked on the
figure's lines, not on the image's pixels), read where the run is (a directory, an object store), and
logger.tensorboard=true writes the same scalars as TensorBoard events. Both on the run tests/test_wandb.py checks
(conftest's tracked_run)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, free_port, make_config

from distrain.commands import plot  # noqa: E402  (jobs/plot.py, distrain plot)
from distrain.config import ConfigError, to_plain
from distrain.driver.validation import validate
from distrain.storage.objectstore import Store
from distrain.storage.tracking import METRICS_FILE, SUMMARY_FILE, Tracker, read_metrics


def lines_of(fig) -> dict[str, tuple[list, list]]:  # noqa: ANN001
    """label → (x, y) of every line the figure's panels draw."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for ax in fig.axes for line in ax.lines}


def test_the_figure_holds_each_runs_metrics_and_restarts(tracked_run, tmp_path: Path):
    run_dir, _, _ = tracked_run
    storage = tmp_path / "runs"
    shutil.copytree(run_dir, storage / "w")
    shutil.copytree(run_dir, storage / "v")  # a second run beside it (the same lines, overlaid)
    (storage / "v" / "metrics.jsonl").write_text(
        "".join(line + "\n" for line in (storage / "v" / "metrics.jsonl").read_text().splitlines()[:3])
    )
    metrics = read_metrics(str(run_dir))
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]

    fig = plot.figure([plot.load_run(storage, "w"), plot.load_run(storage, "v")])
    lines = lines_of(fig)
    for name, lines_kept in (("w", metrics), ("v", metrics[:3])):
        steps = [m["step"] for m in lines_kept]
        for key in ("loss", "lr", "tokens_per_s"):
            assert lines[f"{name} {key}"] == (steps, [m[key] for m in lines_kept]), key
        val = [m for m in lines_kept if "val_loss" in m]
        assert lines[f"{name} val_loss"] == ([m["step"] for m in val], [m["val_loss"] for m in val])
        # the rerun to step 6 resumed from step 4: a restart there, in every panel
        assert lines[f"{name} restart"][0] == [4, 4]
    assert sum(label.endswith("restart") for ax in fig.axes for label in (x.get_label() for x in ax.lines)) == 6
    assert [m["step"] for m in metrics if "val_loss" in m] == [2, 4, 6]


def test_plot_command_writes_the_image_and_refuses_bad_input(tracked_run, tmp_path: Path, capsys):
    run_dir, _, _ = tracked_run
    storage = tmp_path / "runs"
    shutil.copytree(run_dir, storage / "w")
    (storage / "empty").mkdir()
    (storage / "empty" / "metrics.jsonl").write_text("")

    cmd = [sys.executable, "jobs/plot.py", f"run.storage={storage}", "run.name=w"]  # the command as a user runs it
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    out = storage / "w" / "plot.png"
    assert done.returncode == 0 and f"to {out}" in done.stdout, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def job(*args: str) -> tuple[int, str, str]:
        """jobs/plot.py's main in this process: its exit status, stdout and stderr."""
        capsys.readouterr()
        try:
            plot.main([f"run.storage={storage}", *args])
            rc = 0
        except SystemExit as e:
            rc = e.code
        return rc, *capsys.readouterr()

    svg = tmp_path / "both.svg"
    rc, stdout, stderr = job("run.name=w,w", f"out={svg}")
    assert rc == 0 and f"to {svg}" in stdout and svg.read_text().lstrip().startswith("<?xml"), stderr

    for args, says in [
        (["run.name=nope"], "run.name=nope: no run at"),
        (["run.name=empty"], "run empty has no metrics yet"),
        (["run.name=w", f"out={tmp_path / 'x.txt'}"], "x.txt: give a file name ending in one of"),
        (["run.name="], "run.name= names no run"),
    ]:
        rc, _, stderr = job(*args)
        (line,) = stderr.splitlines()
        assert rc == 2 and line.startswith("distrain: error: ") and says in line, stderr
    assert sorted(p.name for p in storage.iterdir()) == ["empty", "w"]  # nothing written by a refused command
    assert sorted(p.name for p in tmp_path.iterdir()) == ["both.svg", "runs"]


def test_plot_reads_runs_on_an_object_store_alone_and_beside_local_ones(tracked_run, s3, tmp_path, monkeypatch, capsys):
    """The run's record on a store (as a run there uploads it): the same lines and restarts as on disk; overlaid
    with a local run (a name that is a run's URL); the picture written here, nothing to the store."""
    run_dir, _, _ = tracked_run
    storage = s3.url("plots")
    Store(storage).upload(run_dir, [METRICS_FILE, SUMMARY_FILE], "w")
    local, remote = plot.load_run(run_dir.parent, "w"), plot.load_run(storage, "w")
    assert (remote.records, remote.restarts) == (local.records, local.restarts) and remote.restarts == [4]
    lines = lines_of(plot.figure([local, plot.load_run(run_dir.parent, f"{storage}/w")]))
    for key in ("loss", "val_loss", "lr", "tokens_per_s", "restart"):
        assert lines[f"{storage}/w {key}"] == lines[f"w {key}"], key

    monkeypatch.chdir(tmp_path)
    plot.main([f"run.storage={storage}", "run.name=w"])
    assert capsys.readouterr().out == f"distrain: plotted w to {tmp_path / 'plot-w.png'}\n"
    assert (tmp_path / "plot-w.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError, match=rf"^run.name=nope: no run at {storage}/nope \(runs in {storage}: w\)"):
        plot.load_run(storage, "nope")
    assert sorted(Store(storage).listing()) == ["w/metrics.jsonl", "w/summary.json"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # the store unreachable: said at once
    with pytest.raises(ConfigError, match=rf"^run.name=w: cannot read the run at {storage}/w: reading .*Could not"):
        plot.load_run(storage, "w")


def tensorboard_scalars(run_dir: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of every `key` scalar in the run's event files, read with TensorBoard's own reader (which
    applies the purge steps), in step order."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    events = EventMultiplexer().AddRunsFromDirectory(str(run_dir / "tensorboard"))
    events.Reload()
    return sorted((e.step, e.value) for run in events.Runs() for e in events.Scalars(run, key))


def test_tensorboard_holds_the_metrics(tracked_run):
    """The run's event files hold every step's metrics once, as metrics.jsonl has them, across its rerun."""
    run_dir, _, _ = tracked_run
    metrics = read_metrics(str(run_dir))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss"):
        got = tensorboard_scalars(run_dir, key)
        want = [(m["step"], pytest.approx(m[key], rel=1e-6)) for m in metrics if key in m]
        assert got == want, key


def test_a_restarted_attempt_replaces_what_tensorboard_had_past_the_checkpoint(tmp_path: Path):
    """An attempt resumed from step 2 after one that logged steps 1-4: TensorBoard, as metrics.jsonl, holds
    steps 3 and 4 once, the new attempt's (the tracker in this process, as rank 0 runs it)."""
    config = to_plain(make_config(tmp_path, "run.name=tb", "logger.tensorboard=true"))
    first = Tracker(str(tmp_path), config, resume_step=0, wandb_run_id=None)
    for step in range(1, 5):
        first.log(step, {"loss": float(step)})
    first.close({})
    second = Tracker(str(tmp_path), config, resume_step=2, wandb_run_id=None)
    for step in range(3, 6):
        second.log(step, {"loss": 10.0 * step})
    second.close({})
    expected = [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]
    assert [(m["step"], m["loss"]) for m in read_metrics(str(tmp_path))] == expected
    assert tensorboard_scalars(tmp_path, "loss") == expected


def test_a_missing_package_is_one_line_naming_its_extra(tracked_run, tmp_path: Path, monkeypatch):
    """Without tensorboard, logger.tensorboard=true is refused by validation (before any worker starts);
    without matplotlib, the plot job says which extra to install. (A None in sys.modules: not installed.)"""
    run_dir, _, _ = tracked_run
    cfg = make_config(tmp_path, "run.name=tb", "logger.tensorboard=true")
    validate(cfg)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(
        ConfigError, match=r'logger.tensorboard=true needs the tensorboard package.*"\.\[tensorboard\]"'
    ):
        validate(cfg)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(
        ConfigError, match=r'draws with matplotlib, which is not installed: pip install -e "\.\[plot\]"'
    ):
        plot.plot(run_dir.parent, [run_dir.name], tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()
