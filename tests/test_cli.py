"""The command line as a new user meets it: sweeps, reruns, typos, bad storage, Ctrl-C, what is left on
disk and on the console, and the README's commands."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, committed_step, free_port, logged_step, make_config
from test_config import run_cli

from distrain.config import ConfigError
from distrain.driver.cli import BadInput, check_overrides, overrides_of
from distrain.driver.launch import train
from distrain.driver.stop import Stopped, stop_signals

STEPS = ["trainer.max_steps=3", "logger.wandb.mode=disabled"]


def one_error(result: subprocess.CompletedProcess, needle: str) -> None:
    """Exit status 2, one `distrain: error:` line holding `needle`, no traceback."""
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("distrain: error:")]
    assert len(errors) == 1 and needle in errors[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("+trainer.max_step=10", "unknown key trainer.max_step; did you mean trainer.max_steps?"),
        ("trainer.max_step=10", "unknown key trainer.max_step; did you mean trainer.max_steps?"),
        ("++optim.l=0.1", "unknown key optim.l; did you mean optim.lr?"),
        ("trainer.max_steps=abc", "trainer.max_steps takes int, not 'abc'"),
        ("optim.lr=1e-3,fast", "optim.lr takes float, not 'fast'"),
        ("run.storage=/sys/distrain-runs", "run.storage='/sys/distrain-runs' cannot hold the run directory"),
        ("--strategy=zero3", "--strategy=zero3: overrides take no dashes; write strategy=zero3"),
        ("--trainer.max_steps=5", "write trainer.max_steps=5"),
        ("--steps=5", "jobs/train.py --help` lists the commands"),  # the python as it was called, then the job
        ("+strategy.context_parallel=2", "unknown key strategy.context_parallel; did you mean strategy.cp?"),
        ("optim.lr=interval(0.001,0.1)", "interval() needs a sweeper that samples, e.g. hydra/sweeper=optuna"),
        (  # Hydra's own keys: its page suggested adding the misspelt one with `+`
            "hydra.sweeper.n_trial=2",
            "unknown key hydra.sweeper.n_trial; did you mean hydra.sweeper.n_trials (with hydra/sweeper=optuna)?",
        ),
    ],
)
def test_bad_input_fails_in_one_line_and_creates_nothing(tmp_path: Path, override: str, needle: str):
    result = run_cli(tmp_path, *TINY, *STEPS, override, *(["-m"] if "," in override else []))
    one_error(result, needle)
    assert list(tmp_path.iterdir()) == []  # no run directory, no Hydra record, no multirun/
    assert not Path("/sys/distrain-runs").exists()


def test_help_says_distrains_commands(tmp_path: Path):
    result = run_cli(tmp_path, "--help")
    assert result.returncode == 0, result.stderr
    for command in ("--plan", "--cfg job", "-m ", "prepare_data.py", "export.py", "generate.py", "plot.py"):
        assert command in result.stdout, command
    assert "strategy: 3d, cp, cp_alltoall, ddp" in result.stdout and "powered by Hydra" not in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_on_impossible_storage_fails_in_one_line(tmp_path: Path):
    one_error(run_cli(tmp_path, "-m", "optim.lr=1e-3,3e-3", "run.storage=/sys/distrain-runs"), "cannot hold the sweep")
    assert list(tmp_path.iterdir()) == [] and not Path("/sys/distrain-runs").exists()


def test_storage_that_is_a_file_is_refused_before_any_worker(tmp_path: Path):
    storage = tmp_path / "runs"
    storage.write_text("not a directory")
    result = run_cli(tmp_path, *TINY, *STEPS, f"run.storage={storage}")
    one_error(result, f"run.storage='{storage}' cannot hold the run directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["strategy.tensor_parallel=2"], "unknown key strategy.tensor_parallel; did you mean strategy.tp?"),
        (["trainer.lr=0.1"], "unknown key trainer.lr; did you mean optim.lr?"),  # a name of another section
        (["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trial=2"], "did you mean hydra.sweeper.n_trials?"),
        (["hydra.verbos=true"], "unknown key hydra.verbos; did you mean hydra.verbose?"),
        (["hydra.sweeper.nonsense=2"], "unknown key hydra.sweeper.nonsense; hydra.sweeper has max_batch_size, params"),
        (["hydra.job.env_set.A=1"], "hydra.job.env_set has no key A yet: add it, +hydra.job.env_set.A=1"),
    ],
)
def test_a_misspelt_key_names_the_one_meant(overrides: list[str], needle: str):
    with pytest.raises(BadInput) as refused:
        check_overrides(overrides_of(overrides))
    assert needle in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_keys_of_free_form_dicts_stay_allowed(tmp_path: Path):
    check_overrides(["+cluster.env_vars.NCCL_DEBUG=INFO", "model._target_=my.Model", "model=nano"])
    check_overrides(["+hydra.job.env_set.A=1", "hydra.run.dir=.", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3"])
    assert make_config(tmp_path, "+cluster.env_vars.NCCL_DEBUG=INFO").cluster.env_vars == {"NCCL_DEBUG": "INFO"}
    with pytest.raises(BadInput, match=r"unknown key trainer\.max_step; did you mean trainer\.max_steps\?"):
        make_config(tmp_path, "+trainer.max_step=10")


def test_a_finished_run_is_extended_or_refused(tmp_path: Path, ray_cluster, capsys):
    first = train(make_config(tmp_path, "run.name=x", "trainer.max_steps=4"))
    assert first["final_step"] == 4
    for steps in (4, 3):  # nothing left to train: refused, never a silent success
        with pytest.raises(ConfigError, match=rf"run 'x' has trained 4 steps, so trainer.max_steps={steps} leaves"):
            train(make_config(tmp_path, "run.name=x", f"trainer.max_steps={steps}", "optim.lr=0.01"))
    capsys.readouterr()
    extended = train(make_config(tmp_path, "run.name=x", "trainer.max_steps=6"))
    assert extended["status"] == "completed" and extended["final_step"] == 6
    said = capsys.readouterr().out
    assert "extending run 'x' from trainer.max_steps=4 to 6, from step 4: the LR schedule stretches" in said


@pytest.mark.timeout(400)
def test_a_sweep_trains_each_point_as_its_own_run(tmp_path: Path):
    # (A point that cannot run is refused before any trains: test_sweepers.py.) On the embedded cluster that
    # cluster.address=local asks for, whatever RAY_ADDRESS names (here a port nothing listens on).
    args = (
        "-m",
        *TINY,
        *STEPS,
        "trainer.global_batch_size=8,16",
        "optim.lr=0.001",
        "run.name=sw",
        "cluster.address=local",
    )
    result = run_cli(tmp_path, *args, ray_address=f"127.0.0.1:{free_port()}")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "Token authentication" not in out and "Traceback" not in out  # Ray's auth mode is set, not warned about
    table = out[out.index("distrain: sweep of 2 points") :]
    assert re.search(r"0 +trainer.global_batch_size=8 +completed +\d\.\d{4}", table), table
    assert re.search(r"1 +trainer.global_batch_size=16 +completed", table), table

    runs = {p.name: p for p in tmp_path.iterdir() if p.name.startswith("sw-")}
    assert sorted(runs) == ["sw-trainer.global_batch_size_16", "sw-trainer.global_batch_size_8"]
    for batch, run_dir in ((8, runs["sw-trainer.global_batch_size_8"]), (16, runs["sw-trainer.global_batch_size_16"])):
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["final_step"] == 3 and summary["resumed_from"] is None
        (config,) = run_dir.glob("hydra/*/.hydra/config.yaml")  # Hydra's record, in the point's own run directory
        assert f"global_batch_size: {batch}" in config.read_text()
        (log,) = run_dir.glob("logs/driver-*.log")  # the console, kept
        assert "completed at step 3" in log.read_text() and str(run_dir) in log.read_text()
    nodes = [{r["node_id"] for r in json.loads((p / "placement.json").read_text())} for p in runs.values()]
    assert nodes[0] == nodes[1]  # one Ray cluster, kept up between the points
    (record,) = (tmp_path / "sweeps").glob("*/sweep.json")  # Hydra's sweep record beside it (multirun.yaml)
    assert [p["status"] for p in json.loads(record.read_text())] == ["completed", "completed"]
    assert (record.parent / "multirun.yaml").exists() and not (tmp_path / "multirun").exists()
    assert not list(tmp_path.rglob("train.log"))  # Hydra's always-empty log is gone
    # A point's name is taken back unquoted on the command line: rerunning it finished is refused in one line.
    one_error(run_cli(tmp_path, *TINY, *STEPS, "run.name=sw-trainer.global_batch_size_8"), "leaves nothing to train")


def interrupt_when(
    tmp_path: Path, ready, *overrides: str, sig: int = signal.SIGINT, group: bool = False
) -> tuple[int, str, float]:
    """Run the entrypoint (run.name=c), send it `sig` (SIGINT: as a terminal's Ctrl-C) once `ready(run_dir)`,
    to its process alone or, with `group`, to its whole process group (as `timeout` and systemd do; the driver
    leads a session of its own, which must be empty 10 s after it ends, and is killed in any case): its exit
    status, its output, and the seconds it took to end after the signal."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    args = [*TINY, f"run.storage={tmp_path}", "run.name=c", "cluster.local_cpus=2", "cluster.local_gpus=0", *overrides]
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "jobs" / "train.py"), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background job ignores it
        start_new_session=group,
    )
    try:
        deadline = time.time() + 150
        while not ready(tmp_path / "c") and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        sent = time.monotonic()
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
        while group and group_alive(proc.pid) and time.monotonic() < sent + took + 10:
            time.sleep(0.1)  # the cluster's processes end with the driver
        left = group and group_alive(proc.pid)
    finally:
        if group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()  # a no-op once it has ended
        proc.wait()
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert not left, f"processes of the driver's group outlived it by 10 s: {out}"
    return proc.returncode, out, took


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_before_the_first_step_stops_at_once_in_one_line_and_leaves_nothing(tmp_path: Path):
    """SIGINT once the ranks' calls went out, the ranks held before their first step (fault.hold_file): nothing to
    save, so the run ends at once (it used to train a step and checkpoint it, in three lines), says so in one
    line, and the run directory it made is gone (Hydra's record, the console log, placement.json: it had
    trained nothing)."""
    hold = tmp_path / "hold"
    hold.touch()

    def launched(run_dir: Path) -> bool:
        return (run_dir / "placement.json").exists()

    code, out, took = interrupt_when(tmp_path, launched, *STEPS, f"fault.hold_file={hold}")
    assert code == 130, out
    said = [line for line in out.splitlines() if line.startswith("distrain:")]
    assert said == ["distrain: stopped by SIGINT: run 'c' has trained nothing (exit status 130)"], out
    assert took < 10, (took, out)
    assert sorted(p.name for p in tmp_path.iterdir() if ".held." not in p.name) == ["hold"]


def test_a_stop_whose_interrupt_was_swallowed_still_stops():
    """A signal that stops at once raises KeyboardInterrupt wherever the main thread is: inside a fork handler
    (Ray starting its processes) or a finaliser, Python prints it as ignored and goes on, and the run went on
    starting. The wait it came in, or the next, ends as Stopped all the same."""
    with stop_signals() as stop:

        def swallowed() -> str:
            with contextlib.suppress(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
            return "went on"

        with pytest.raises(Stopped) as stopped:
            stop.guard(swallowed)
        assert stopped.value.signum == signal.SIGINT
        with pytest.raises(Stopped):
            stop.guard(lambda: "the next wait")


def test_a_second_signal_stops_at_once_and_says_so_in_one_line():
    said: list[str] = []
    with stop_signals() as stop:
        stop.forward_to(lambda: True, said.append)  # the first is taken: a clean stop under way

        def stopping() -> None:
            signal.raise_signal(signal.SIGINT)
            assert said == []
            signal.raise_signal(signal.SIGINT)

        with pytest.raises(Stopped):
            stop.guard(stopping)
    assert said == ["SIGINT again: stopping now, without waiting for the ranks' checkpoint"]


AT_EXIT = """
import atexit, os, runpy, signal, sys, time
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(5)))  # runs last: as Ray's exit hook ends
sys.argv = ["jobs/train.py", "+trainer.max_step=10"]
runpy.run_path("jobs/train.py", run_name="__main__")
"""


def test_a_signal_while_the_driver_exits_ends_it_in_one_line():
    """After its last line the driver runs Ray's exit hook (a second Ctrl-C lands there): a signal then ends it
    at once with the status it was exiting with, in one line, not with a traceback out of the hook."""
    done = subprocess.run([sys.executable, "-c", AT_EXIT], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == "distrain: SIGINT: exiting now (exit status 2)", done.stderr
    assert "Traceback" not in done.stderr


def test_ctrl_c_during_training_checkpoints_and_exits_130(tmp_path: Path):
    code, out, took = interrupt_when(tmp_path, lambda run_dir: logged_step(run_dir) >= 2, "trainer.max_steps=100000")
    step = committed_step(tmp_path / "c")  # the newest checkpoint that is whole (manifest and files)
    assert code == 130 and step >= 2, out
    assert took < 20, (took, out)
    assert f"stopped by SIGINT: run 'c' resumes from step {step}" in out
    assert "no evaluation" in out and "val loss nan" not in out, out  # a stop skips the final evaluation
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["status"] == "stopped"


def test_sigterm_to_the_process_group_while_the_cluster_starts_stops_at_once(tmp_path: Path):
    """`timeout -s TERM` and systemd signal the driver's whole process group, which holds the embedded
    cluster's GCS and raylet: they must outlive the signal (the GCS used to die under ray.init, which waited
    for it, and the driver ended with no line after 30 s; in training, it waited a minute on the dead GCS,
    its lock left behind). Once the GCS runs, as ray.init starts the rest, is where that showed every time."""
    code, out, _ = interrupt_when(
        tmp_path, lambda run_dir: gcs_started(tmp_path), *STEPS, sig=signal.SIGTERM, group=True
    )
    assert code == 143, out
    assert "stopped by SIGTERM: run 'c' has trained nothing (exit status 143)" in out
    assert not (tmp_path / "c").exists()


def gcs_started(storage: Path) -> bool:
    """Whether a GCS runs whose parent, a driver, was given run.storage=`storage`."""
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError):
            if comm.read_text().strip() == "gcs_server":
                parent = (comm.parent / "stat").read_text().rsplit(")", 1)[1].split()[1]
                if f"run.storage={storage}".encode() in Path(f"/proc/{parent}/cmdline").read_bytes():
                    return True
    return False


class SilentPort:
    """A port on 127.0.0.1 that takes connections and never answers, as a wedged or firewalled head does."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.held: list[socket.socket] = []

    def accepted(self) -> bool:
        """Whether a client (the driver) has connected."""
        try:
            self.held.append(self.listener.accept()[0])
        except BlockingIOError:
            pass
        return bool(self.held)

    def close(self) -> None:
        for conn in [*self.held, self.listener]:
            conn.close()


@pytest.fixture
def silent_gcs():
    port = SilentPort()
    yield port
    port.close()


@pytest.mark.timeout(30)
def test_an_address_where_no_gcs_answers_is_named_at_once(tmp_path: Path):
    """Before ray.init: an address that is no host:port, a port nothing listens on, and something that answers
    but not in HTTP/2 (a web server: the dashboard's port given for the GCS's), each in its own words."""
    from distrain.cluster.runtime import AttachError, probe

    with pytest.raises(AttachError, match=r"'head:port' is not host:port \(the head's GCS port"):
        probe("head:port", 2)
    closed = f"127.0.0.1:{free_port()}"
    with pytest.raises(AttachError, match=rf"cannot attach to the Ray cluster at {closed} .*: connection refused;"):
        probe(closed, 2)
    with socket.create_server(("127.0.0.1", 0)) as web:
        address = f"127.0.0.1:{web.getsockname()[1]}"

        def answer() -> None:
            conn, _ = web.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        server = threading.Thread(target=answer, daemon=True)
        server.start()
        with pytest.raises(AttachError, match="something answers there, but not a Ray cluster's GCS"):
            probe(address, 5)
        server.join(5)


def test_attaching_to_a_silent_address_gives_up_in_bounded_time(tmp_path: Path, silent_gcs):
    """Ray alone retries a dead GCS for about 12 minutes with only its own warnings: the driver gives up after
    cluster.connect_timeout_s, in one line naming the address and what to check, and writes nothing."""
    address = silent_gcs.address
    started = time.monotonic()
    result = run_cli(tmp_path, *TINY, *STEPS, f"cluster.address={address}", "cluster.connect_timeout_s=2")
    one_error(result, f"cannot attach to the Ray cluster at {address} (cluster.address): no answer within 2 s")
    assert "ray status --address" in result.stderr and "RAY_ADDRESS" in result.stderr
    assert time.monotonic() - started < 30 and "GCS" not in result.stdout  # no flood of Ray's warnings
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_attaching_stops_at_once(tmp_path: Path, silent_gcs):
    address = silent_gcs.address
    overrides = (*STEPS, f"cluster.address={address}", "cluster.connect_timeout_s=300")
    code, out, took = interrupt_when(tmp_path, lambda run_dir: silent_gcs.accepted(), *overrides)
    assert code == 130 and "stopped by SIGINT: run 'c' has trained nothing (exit status 130)" in out, out
    assert f"attaching to the Ray cluster at {address}" in out
    assert took < 5, (took, out)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
def test_a_stop_before_the_first_step_is_stoppedbeforestart_to_a_caller_of_train(tmp_path: Path, silent_gcs):
    """The API's side of the test above: `train()` stopped while it attaches raises StoppedBeforeStart (a Stopped),
    which tells its caller nothing trained and has a run directory it made emptied (rerun.leaving_nothing)."""
    script = f"""
import pathlib, sys
sys.path.insert(0, {str(REPO / "tests")!r})
from conftest import make_config
from distrain.driver.launch import train
from distrain.driver.stop import Stopped
cfg = make_config(pathlib.Path({str(tmp_path)!r}), "run.name=c", "cluster.address={silent_gcs.address}",
                  "cluster.connect_timeout_s=300", "logger.wandb.mode=disabled")
try:
    train(cfg)
except Stopped as e:
    print("raised", type(e).__name__, e.signum)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not silent_gcs.accepted() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert f"raised StoppedBeforeStart {int(signal.SIGINT)}" in out, out


@pytest.mark.timeout(120)
def test_no_process_of_the_embedded_cluster_outlives_the_run(tmp_path: Path):
    """Ray's shutdown SIGKILLs the embedded cluster at once (`runtime.kill_at_shutdown`): what its processes
    started (the raylet's agents) must end too. Each of them started here works in the run's folder."""
    result = run_cli(tmp_path, *TINY, "trainer.max_steps=2", "logger.wandb.mode=disabled")
    assert result.returncode == 0, result.stderr[-3000:]

    def left() -> list[str]:
        here = []
        for cwd in Path("/proc").glob("[0-9]*/cwd"):
            with contextlib.suppress(OSError):
                if Path(os.readlink(cwd)).is_relative_to(tmp_path):
                    here.append((cwd.parent / "comm").read_text().strip())
        return here

    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left(), left()


def test_an_embedded_cluster_that_does_not_start_is_tried_again_then_one_line(tmp_path: Path):
    """Ray failing to start (here: its temp dir cannot be made) is tried once more, as a user would, then ends
    in one line (exit status 1: not the input), with the run directory it had made gone again."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_TMPDIR": "/sys/distrain-no-ray"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "train.py"), *TINY, *STEPS, f"run.storage={tmp_path}", "run.name=s"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in out, out
    (again,) = [line for line in out.splitlines() if "starting it once more" in line]
    assert again.startswith("distrain: the embedded Ray cluster did not start (PermissionError"), again
    (error,) = [line for line in out.splitlines() if line.startswith("distrain: error:")]
    assert "the embedded Ray cluster did not start, twice: PermissionError" in error
    assert "/sys/distrain-no-ray/ray/session_latest/logs" in error
    assert "loaded machine" not in error  # that advice is for a start that timed out
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_run_to_plot_names_the_one_meant(tmp_path: Path):
    from distrain.commands import plot

    (tmp_path / "first").mkdir()
    (tmp_path / "first" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(ConfigError, match=r"run.name=firts: no run at .*; did you mean run.name=first\?$"):
        plot.load_run(tmp_path, "firts")


def test_readme_commands_use_the_virtual_environment():
    """Every command in the README runs as written after `make setup`, without an activated environment: no
    bare `python` (but for a `ray job submit` entrypoint, which runs in the cluster's environment)."""
    lines = (REPO / "README.md").read_text().splitlines()
    bare = [
        line
        for before, line in zip(["", *lines], lines, strict=False)
        if re.search(r"(^|[\s`$(])python3? ", line) and not before.rstrip().endswith("-- \\")
    ]
    assert bare == []
