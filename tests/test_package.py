"""An installed distrain, not a checkout (issue 46): the `distrain` command and its subcommands, presets of a
user's own through Hydra's `--config-dir`, the version, and `ray job submit` with no checkout anywhere.

The wheel is built once (the module's fixture) from this checkout, as `make wheelhouse` builds it, and pip
installs it into fresh venvs outside the checkout, offline. A venv gets the test environment's dependencies
(torch, Ray, Hydra, ...) from a folder of links named by a .pth file, distrain's own (the checkout's editable
install) left out: only the wheel can give it distrain. The one 3-step run is `ray job submit`'s, on a head
started from a venv without distrain: the job's runtime env installs the wheel, and the entrypoint is
`distrain train` with a user's model preset from `--config-dir`, from the head's empty folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tomllib
import uuid
from pathlib import Path

import pytest
from conftest import REPO, TINY

from distrain import __version__, commands
from distrain.commands import cluster, main
from distrain.commands.wheelhouse import own_wheel
from distrain.driver.cli import BadInput, compose, config_dirs
from distrain.driver.sweep import check_points
from distrain.storage import checkpoint

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
PRESET = "# a user's own model preset, outside the package\nname: mine\ndim: 32\nn_layers: 2\nn_heads: 2\nffn_dim: 64\n"
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
RAY = str(Path(sys.executable).parent / "ray")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The wheel, the folder of links to this environment's packages but distrain, the user's presets."""
    root = tmp_path_factory.mktemp("package")
    site = root / "site"
    site.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(("distrain", "__editable__")) and entry.suffix != ".pth":
            (site / entry.name).symlink_to(entry)
    presets = root / "presets" / "model"
    presets.mkdir(parents=True)
    (presets / "mine.yaml").write_text(PRESET)
    return {"root": root, "wheel": own_wheel(root / "dist"), "site": site, "presets": presets.parent}


@pytest.fixture(autouse=True)
def as_called(monkeypatch):
    """The dispatcher records how it was called (commands.CALLED) and sets sys.argv: both put back after each test,
    for the other modules this process runs."""
    monkeypatch.setitem(commands.CALLED, "as", None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))


def venv(built: dict, name: str, wheel: bool) -> Path:
    """A fresh venv (no pip of its own) seeing this environment's packages but distrain; the wheel installed
    by pip if `wheel`. Its python."""
    path = built["root"] / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    (next(path.glob("lib/python3.*/site-packages")) / "deps.pth").write_text(f"{built['site']}\n")
    python = path / "bin" / "python"
    if wheel:
        install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", str(built["wheel"])]
        subprocess.run(install, check=True, timeout=120, env=outside(), capture_output=True)  # no PYTHONPATH: its
        # distrain.egg-info (the build's) would be taken for distrain installed already
    return python


def outside(**extra: str) -> dict:
    """An environment with no trace of the checkout: no PYTHONPATH, no Ray variables of the tests."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("RAY_")}
    return {**env, **OFFLINE, **extra}


def test_the_command_lists_dispatches_and_says_its_version(capsys):
    """`distrain` alone, --help, --version, a misspelt command, each subcommand's --help (its docstring)."""
    assert __version__ == VERSION and f"\n## {VERSION} " in (REPO / "CHANGELOG.md").read_text()  # the version, said
    assert main([]) == 2 and "commands:" in capsys.readouterr().err
    assert main(["--version"]) == 0 and capsys.readouterr().out == f"distrain {VERSION}\n"
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"\n  {name} " in listed for name in ("train", "prepare-data", "cluster", "wheelhouse")), listed
    assert main(["trian"]) == 2
    said = capsys.readouterr().err
    assert said == "distrain: error: no command 'trian'; did you mean train? `distrain --help` lists them\n"
    helps = {"export": "run.name=", "plot": "run.name=", "prepare-data": "data.path=", "cluster": "start"}
    for name, says in helps.items():
        says = f"distrain {name} {says}"
        assert main([name, "--help"]) in (0, None) and says in capsys.readouterr().out, name
    with pytest.raises(SystemExit) as done:
        main(["wheelhouse", "--help"])
    assert done.value.code == 0 and "usage: distrain wheelhouse" in capsys.readouterr().out


def test_a_users_preset_comes_from_config_dir(built):
    """A model preset of the user's own, in a folder of theirs: composed beside the shipped ones; a folder that is
    not there refused in one line."""
    cfg = compose([*TINY, "model=mine"], built["presets"])
    assert (cfg.model.name, cfg.model.dim, cfg.model.n_layers) == ("mine", 32, 2)
    dirs = config_dirs(["--config-dir", str(built["presets"])])
    assert check_points([*TINY, "model=glob(mi*)", "optim.lr=1e-3,2e-3"], {"model", "optim.lr"}, dirs) == [
        "model=mine optim.lr=0.001",
        "model=mine optim.lr=0.002",
    ]  # a sweep's glob() sees the user's presets, as hydra.main's sweep does
    with pytest.raises(BadInput, match=r"unknown model 'mine' \(model=mine\); choose one of: .*nano"):
        compose(["model=mine"])  # without the folder
    with pytest.raises(BadInput, match=r"^--config-dir /nonexistent: no such directory"):
        compose(["model=mine"], "/nonexistent")


@pytest.mark.timeout(300)
def test_the_wheel_installs_and_composes_outside_the_checkout(built, tmp_path):
    """pip installs the wheel into a fresh venv; from an empty folder, `distrain` is that venv's, holds the
    presets (package data) and finds the user's with --config-dir."""
    python = venv(built, "installed", wheel=True)
    env, here = outside(), tmp_path / "empty"
    here.mkdir()

    def run(*cmd: str) -> str:
        done = subprocess.run(cmd, cwd=here, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    assert run(str(python), "-c", "import distrain; print(distrain.__file__)").startswith(str(python.parents[1]))
    assert run(str(python.parent / "distrain"), "--version") == f"distrain {VERSION}\n"
    preset = ["--config-dir", str(built["presets"]), "model=mine"]
    composed = run(str(python), "-m", "distrain", "train", "--cfg", "job", *preset)
    assert "name: mine" in composed and "dim: 32" in composed and "name: ddp" in composed
    assert list(here.iterdir()) == []


@pytest.mark.timeout(420)
def test_ray_job_submit_installs_the_wheel_and_trains(built, tmp_path):
    """A head whose Python has no distrain (nor PYTHONPATH, nor a package index); `ray job submit` with the wheel
    in the runtime env's pip and `distrain train` as the entrypoint: the job trains 3 steps with the user's preset,
    and summary.json and the checkpoint record the version."""
    python = venv(built, "head", wheel=False)
    ray = f"#!{python}\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n"  # its own `ray`
    (python.parent / "ray").write_text(ray)
    (python.parent / "ray").chmod(0o755)
    marker = f"DISTRAIN_TEST_HEAD={uuid.uuid4().hex}"
    env = outside(**dict([marker.split("=")]))
    here = tmp_path / "head"
    here.mkdir()
    # `distrain cluster start`'s code, from the checkout for this process only: the head inherits no path to it
    start = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); from distrain.commands import cluster as c; c.main(['start'])"
    )
    started = subprocess.run([str(python), "-c", start], cwd=here, env=env, capture_output=True, text=True, timeout=120)
    exported = dict(kv.split("=", 1) for kv in started.stdout.removeprefix("export ").split())
    try:
        assert started.returncode == 0 and "RAY_ADDRESS" in exported, started.stderr
        storage = tmp_path / "runs"
        runtime = {"pip": {"packages": [str(built["wheel"])]}}
        overrides = [*TINY, "model=mine", "trainer.max_steps=3", "checkpoint.interval=3", "cluster.num_workers=1"]
        cmd = [RAY, "job", "submit", "--runtime-env-json", json.dumps(runtime), "--", "distrain", "train"]
        cmd += ["--config-dir", str(built["presets"]), *overrides, f"run.storage={storage}", "run.name=submitted"]
        done = subprocess.run(cmd, cwd=here, env={**env, **exported}, capture_output=True, text=True, timeout=360)
        said = done.stdout + done.stderr
        assert done.returncode == 0 and "succeeded" in said, said
        summary = json.loads((storage / "submitted" / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["final_step"] == 3
        assert summary["distrain_version"] == VERSION
        meta = checkpoint.read_meta(checkpoint.latest(storage / "submitted" / "checkpoints"))
        assert meta["step"] == 3 and meta["distrain_version"] == VERSION
    finally:
        if "RAY_ADDRESS" in exported:
            cluster.end(cluster.temp_dir(int(exported["RAY_ADDRESS"].rpartition(":")[2])))
        for pid in cluster.processes(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
