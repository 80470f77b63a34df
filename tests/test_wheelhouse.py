"""`make wheelhouse`'s folder installs distrain with no package index into a Python that has torch.

The folder is built for this machine (its downloads need the package index, as `make setup` does). A fresh
venv then gets this environment's torch, and what torch requires, as a GPU node's venv made with
--system-site-packages gets the image's: from outside the venv, here a folder of links on its sys.path
through a .pth file (pip never uninstalls outside the venv). The printed install line runs with --no-index
and no pip configuration, so the folder is the only source; every distrain module then imports outside the
checkout, and the checkout's editable install from the folder composes the main job's config.
"""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from distrain.testing import processes

REPO = Path(__file__).resolve().parent.parent
from distrain.commands import wheelhouse  # noqa: E402  (jobs/wheelhouse.py)


def test_platform_tags() -> None:
    """A manylinux_2_X tag stands for every older one, the legacy names included (pip expands only those)."""
    target = wheelhouse.Target.of("3.12", "manylinux_2_28_x86_64")
    tags = target.tags
    assert target.arch == "x86_64" and tags[0] == "manylinux_2_28_x86_64"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags
    target = wheelhouse.Target.of("3.12", "manylinux2014_aarch64")
    assert target.arch == "aarch64" and target.tags[0] == "manylinux_2_17_aarch64"
    assert "manylinux2014_aarch64" in target.tags and str(target) == "CPython 3.12 on manylinux2014_aarch64"


@pytest.mark.parametrize(
    "args, said",
    [
        (["--platform", "macosx_11_0_arm64"], "--platform macosx_11_0_arm64: not a manylinux tag"),
        (["--platform", "manylinux_2_28_sparc"], "not a manylinux tag"),
        (["--python", "3"], "--python 3: give a CPython version"),
        (["--python", "3.10"], "distrain requires Python >=3.11"),
        (["--extras", "hf,nope"], "distrain has no extra nope"),
        (["--out", str(REPO / "README.md")], "exists and is not a wheelhouse"),
    ],
)
def test_bad_input_is_one_line(args: list[str], said: str, capsys: pytest.CaptureFixture) -> None:
    """Refused before anything is built or downloaded."""
    assert wheelhouse.main(args) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err


def test_an_installed_distrain_sends_you_to_a_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """distrain's own wheel is built from a checkout: an installed one (no pyproject.toml above its package, as in
    site-packages) says so in one line before anything is built."""
    monkeypatch.setattr(wheelhouse, "ROOT", tmp_path)
    assert wheelhouse.main(["--out", str(tmp_path / "wheels")]) == 2
    err = capsys.readouterr().err
    assert "distrain's own wheel is built from a checkout" in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_needed_follows_target_markers_and_leaves_torch_out() -> None:
    """The target's markers decide, not this machine's; torch and what only torch requires are left out;
    extras are followed; a requirement pip did not resolve (its marker false here) is reported."""

    def meta(*requires: str) -> dict:
        return {"metadata": {"requires_dist": list(requires)}}

    items = {
        "distrain": meta(
            "torch>=2.11",
            "ray[default]",
            "old; python_version < '3.12'",
            "new; python_version >= '3.12'",
            "transformers; extra == 'hf'",
        ),
        "torch": meta("sympy", "filelock", "nvidia-cublas; platform_machine == 'x86_64'"),
        "ray": meta("filelock", "aiohttp; extra == 'default'", "py-spy; platform_machine == 'x86_64'"),
        **{name: meta() for name in ("sympy", "filelock", "nvidia-cublas", "aiohttp", "py-spy", "old", "transformers")},
    }
    keep, missing = wheelhouse.needed(
        items, [Requirement("distrain")], wheelhouse.Target.of("3.12", "manylinux_2_28_aarch64").markers()
    )
    assert keep == {"distrain", "ray", "filelock", "aiohttp"} and missing == ["new"]
    keep, missing = wheelhouse.needed(
        items, [Requirement("distrain[hf]")], wheelhouse.Target.of("3.11", "manylinux_2_28_x86_64").markers()
    )
    assert keep == {"distrain", "ray", "filelock", "aiohttp", "py-spy", "old", "transformers"} and missing == []


def fake_wheel(folder: Path, name: str, *requires: str) -> None:
    """A wheel of `name` 1.0 with nothing in it but its metadata."""
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{name}-1.0.dist-info/METADATA", meta)
        whl.writestr(f"{name}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{name}-1.0.dist-info/RECORD", "")


def test_a_requirement_of_the_target_only_is_resolved_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """pip, on this machine, leaves out a requirement whose marker holds on the target only; the tool adds it
    and resolves again (real pip, local wheels, no index)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    fake_wheel(tmp_path, "top", "later; python_version >= '3.99'", "torch")
    fake_wheel(tmp_path, "later")
    fake_wheel(tmp_path, "torch")
    target = wheelhouse.Target.of("3.99", "manylinux_2_28_x86_64")
    items, keep = wheelhouse.resolve_target(["top"], [Requirement("top")], target, tmp_path / "r.json", tmp_path, [])
    assert keep == {"top", "later"} and "torch" in items
    assert "later: required on the target only; resolving again" in capsys.readouterr().out


def link_torch(site: Path) -> None:
    """Links in `site` to this environment's torch and every distribution it requires."""
    todo, seen = ["torch"], set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        dist = importlib.metadata.distribution(name)
        for top in {Path(f).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if not (site / top).exists():
                (site / top).symlink_to(dist.locate_file(top))
        requires = [Requirement(r) for r in dist.requires or []]
        todo += [r.name for r in requires if not r.marker or r.marker.evaluate()]


@pytest.mark.timeout(480)
def test_offline_install(tmp_path: Path) -> None:
    """The folder for this machine: no torch, every requirement of distrain; the line it prints installs
    from it alone; distrain then imports and composes its config (see the module's docstring)."""
    out, venv, site = tmp_path / "wheelhouse", tmp_path / "venv", tmp_path / "node-torch"
    try:
        cmd = [sys.executable, "jobs/wheelhouse.py", "--out", str(out)]
        done = processes.run_command(cmd, tmp_path / "build.log", 300)
        assert done.rc == 0, done.tail()
        line = done.tail(1).strip()
        assert line.startswith("python -m pip install --no-index --find-links "), done.tail()
        assert line in (out / "INSTALL.txt").read_text()

        made = wheelhouse.wheels(out)
        torch = [n for n in made if n == "torch" or n.startswith(("nvidia-", "triton", "cuda-"))]
        assert not torch, sorted(made)
        runtime = [Requirement(r) for r in importlib.metadata.requires("distrain")]
        wanted = {canonicalize_name(r.name) for r in runtime if not r.marker or r.marker.evaluate()} - {"torch"}
        assert wanted | {"distrain", "antlr4-python3-runtime", "setuptools"} <= set(made), sorted(made)
        assert made["antlr4-python3-runtime"].name.endswith("-none-any.whl")  # built here: hydra's sdist-only dep

        python = venv / "bin" / "python"
        assert processes.run_command([sys.executable, "-m", "venv", str(venv)], tmp_path / "venv.log", 120).rc == 0
        site.mkdir()
        link_torch(site)
        (next(venv.glob("lib/python3.*/site-packages")) / "node_torch.pth").write_text(f"{site}\n")
        # no pip configuration, and the folder as the only find-links: pip may look nowhere else; no PYTHONPATH (a
        # checkout's distrain.egg-info there is taken for distrain installed, and pip installs nothing)
        offline = {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": str(out), "PYTHONPATH": ""}
        done = processes.run_command([str(python), *shlex.split(line)[1:]], tmp_path / "install.log", 240, offline)
        assert done.rc == 0, done.tail()

        check = (
            "import importlib, pkgutil, distrain, ray, hydra, omegaconf, wandb, torch; "
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages(distrain.__path__, 'distrain.')]; "
            "print(distrain.__file__)"
        )
        # -I: the checkout's distrain is not on the path (nor PYTHONPATH): the venv's must import
        done = processes.run_command([str(python), "-I", "-c", check], tmp_path / "import.log", 120)
        assert done.rc == 0 and done.tail(1).startswith(str(venv)), done.tail()

        editable = [str(python), *shlex.split(line)[1:-1], "-e", str(REPO)]
        assert processes.run_command(editable, tmp_path / "editable.log", 120, offline).rc == 0
        done = processes.run_command([str(python), "jobs/train.py", "--cfg", "job"], tmp_path / "cfg.log", 120)
        assert done.rc == 0 and "_target_: distrain.model.llama.Transformer" in done.log.read_text(), done.tail()
    finally:
        for folder in (out, venv, site):
            shutil.rmtree(folder, ignore_errors=True)
