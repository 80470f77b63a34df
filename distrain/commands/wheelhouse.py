"""A folder of wheels that installs distrain with no package index, for GPU nodes without internet:

    distrain wheelhouse [--python 3.12] [--platform manylinux_2_28_x86_64] [--extras hf] [--out DIR]
    (in a checkout: make wheelhouse, or python jobs/wheelhouse.py [...]; it builds distrain's wheel from there)

Run it where pip reaches a package index. The folder gets distrain's wheel, a wheel of every package it
needs on the target (a CPython version and a manylinux platform; default this machine's) except torch and
what only torch needs: the node's own torch (a CUDA build of several GB) is used. It also gets distrain's
build requirements, so that a checkout installs editable offline, and INSTALL.txt, whose command

    python -m pip install --no-index --find-links DIR distrain

installs it into a Python that already has torch. Steps: build distrain's wheel; resolve on this machine
with sdists allowed, to find the dependencies published only as sdists, and build their wheels (kept if
pure Python: a compiled one would be for this machine, not the target); resolve for the target (metadata
only, wheels only); keep the packages the target needs (its environment markers, evaluated here, not
pip's, which are this machine's); download their wheels.
Bad input, or a dependency without a wheel for the target: one line and exit status 2."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]  # the checkout whose wheel is built (an installed distrain has none)
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
EXCLUDED = "torch"  # the node's own; nothing it alone requires is kept either
ARCHES = ("x86_64", "aarch64", "ppc64le", "s390x", "i686", "armv7l")
PLATFORM = re.compile(rf"manylinux_2_(\d+)_({'|'.join(ARCHES)})|manylinux(1|2010|2014)_({'|'.join(ARCHES)})")
LEGACY = {"1": 5, "2010": 12, "2014": 17}  # the old manylinux names and the glibc 2.x they stand for
NOTE = "INSTALL.txt"


class WheelhouseError(Exception):
    """Bad input or an unbuildable wheelhouse, said in one line."""


@dataclass(frozen=True)
class Target:
    """The CPython version and manylinux platform the wheels are for."""

    python: str  # 3.12 or 3.12.4
    platform: str  # manylinux_2_28_x86_64
    arch: str
    tags: tuple[str, ...]  # every platform tag a wheel for it may carry

    @classmethod
    def of(cls, python: str, platform: str) -> Target:
        """Checked; the tags of manylinux_2_28_x86_64 are it, manylinux_2_27_x86_64 ... manylinux2014_x86_64
        ... manylinux1_x86_64 (pip expands only the old names)."""
        if not re.fullmatch(r"3\.\d+(\.\d+)?", python):
            raise WheelhouseError(f"--python {python}: give a CPython version such as 3.12")
        m = PLATFORM.fullmatch(platform)
        if not m:
            raise WheelhouseError(
                f"--platform {platform}: not a manylinux tag; give e.g. manylinux_2_28_x86_64 (glibc ≥ 2.28, "
                f"x86_64) or manylinux_2_28_aarch64 (architectures: {', '.join(ARCHES)})"
            )
        glibc, arch = (int(m[1]), m[2]) if m[1] else (LEGACY[m[3]], m[4])
        tags = []
        for minor in range(glibc, 4, -1):
            tags.append(f"manylinux_2_{minor}_{arch}")
            tags += [f"manylinux{name}_{arch}" for name, legacy in LEGACY.items() if legacy == minor]
        return cls(python, platform, arch, tuple(tags))

    def pip_options(self) -> list[str]:
        """What makes pip choose wheels for the target (and only wheels)."""
        options = ["--only-binary=:all:", "--implementation", "cp", "--python-version", self.python]
        return options + [arg for tag in self.tags for arg in ("--platform", tag)]

    def markers(self) -> dict[str, str]:
        """Its environment markers (pip evaluates them for this machine)."""
        return default_environment() | {
            "python_version": ".".join(self.python.split(".")[:2]),
            "python_full_version": self.python if self.python.count(".") == 2 else f"{self.python}.0",
            "implementation_name": "cpython",
            "platform_python_implementation": "CPython",
            "os_name": "posix",
            "sys_platform": "linux",
            "platform_system": "Linux",
            "platform_machine": self.arch,
        }

    def folder(self) -> str:
        """The default folder's name, which says what it is for (and is no Python module's name)."""
        return f"wheelhouse-cp{''.join(self.python.split('.')[:2])}-{self.platform}"

    def __str__(self) -> str:
        return f"CPython {self.python} on {self.platform}"


def this_platform() -> str:
    """This machine's newest manylinux tag (its glibc and architecture)."""
    for tag in sys_tags():
        if tag.platform.startswith("manylinux_"):
            return tag.platform
    raise WheelhouseError("this machine is not a manylinux one; give the target with --platform")


def pip(*args: str, what: str) -> None:
    """Run pip quietly; on failure, one line: what was being done and pip's own last error."""
    done = subprocess.run([*PIP, *args], capture_output=True, text=True)
    if done.returncode:
        errors = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        said = [line for line in errors if line.startswith("ERROR:")] or errors or ["(no message)"]
        missing = re.search(r"No matching distribution found for (\S+)|for your environment:\s+(\S+)", done.stderr)
        if missing:
            name = missing[1] or missing[2]
            raise WheelhouseError(f"{what}: pip found nothing that fits {name} ({said[-1]})")
        raise WheelhouseError(f"{what}: pip failed ({said[-1]})")


def resolve(requirements: list[str], report: Path, *options: str, what: str) -> dict[str, dict]:
    """The packages pip would install for `requirements` (metadata only, nothing downloaded but sdists
    whose metadata must be built), by name."""
    args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), *options]
    pip(*args, *requirements, what=what)
    return {canonicalize_name(item["metadata"]["name"]): item for item in json.loads(report.read_text())["install"]}


def build_pure(items: dict[str, dict], out: Path) -> list[str]:
    """A wheel of each item pip would install from an sdist (no wheel of it fits this machine), kept if pure
    Python; the others are returned, said in a few words: the target may have wheels of them."""
    unbuilt = []
    for name, item in items.items():
        if item["download_info"]["url"].endswith(".whl"):
            continue
        version = item["metadata"]["version"]
        progress(f"building a wheel of {name} {version} (published as an sdist only)")
        with tempfile.TemporaryDirectory() as tmp:
            try:
                pip("wheel", "--no-deps", "--quiet", "-w", tmp, f"{name}=={version}", what="pip wheel")
            except WheelhouseError as e:
                unbuilt.append(f"{name} {version} ({e})")
                continue
            (wheel,) = Path(tmp).glob("*.whl")
            if wheel.name.endswith("-none-any.whl"):
                shutil.move(wheel, out / wheel.name)
            else:
                unbuilt.append(f"{name} {version} (its sdist builds {wheel.name}, not pure Python)")
    return unbuilt


def needed(items: dict[str, dict], roots: list[Requirement], env: dict[str, str]) -> tuple[set[str], list[str]]:
    """The names `roots` need on the target, torch and what only torch requires left out, and the
    requirements pip left unresolved because their markers hold on the target but not on this machine."""
    keep: set[str] = set()
    missing: list[str] = []
    todo = [(canonicalize_name(root.name), extra) for root in roots for extra in ("", *root.extras)]
    seen: set[tuple[str, str]] = set()
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen or name == EXCLUDED:
            continue
        seen.add((name, extra))
        keep.add(name)
        for line in items[name]["metadata"].get("requires_dist", []):
            req = Requirement(line)
            if req.marker and not req.marker.evaluate({**env, "extra": extra}):
                continue
            dep = canonicalize_name(req.name)
            if dep not in items and dep != EXCLUDED:
                req.marker = None
                missing += [str(req)] if str(req) not in missing else []
                continue
            todo += [(dep, e) for e in ("", *req.extras)]
    return keep, missing


def progress(line: str) -> None:
    print(f"wheelhouse: {line}", flush=True)


def build(out: Path, target: Target, extras: list[str]) -> str:
    """Write the wheelhouse to `out` (replaced if it is an earlier wheelhouse) and return its install line."""
    if not (ROOT / "pyproject.toml").is_file():
        raise WheelhouseError(
            f"distrain's own wheel is built from a checkout, and this distrain is an installed one "
            f"({Path(__file__).resolve().parents[1]}): run "
            "`make wheelhouse` (or python jobs/wheelhouse.py) in a clone of distrain"
        )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    unknown = set(extras) - set(project["project"].get("optional-dependencies", {}))
    if unknown:
        raise WheelhouseError(f"--extras: distrain has no extra {', '.join(sorted(unknown))}")
    supported = project["project"]["requires-python"]
    if not SpecifierSet(supported).contains(target.python):
        raise WheelhouseError(f"--python {target.python}: distrain requires Python {supported}")
    if out.exists() and not (out / NOTE).exists():
        raise WheelhouseError(f"--out {out} exists and is not a wheelhouse; give a new folder")
    spec = f"[{','.join(extras)}]" if extras else ""
    roots = [Requirement(f"distrain{spec}"), *map(Requirement, project["build-system"]["requires"])]
    staging = out.parent / f".{out.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            progress("[1/5] building distrain's wheel")
            root = f"{own_wheel(staging)}{spec}"
            progress("[2/5] resolving on this machine, to find the dependencies published as sdists only")
            here = resolve([root], Path(tmp) / "here.json", "--prefer-binary", what="resolving here")
            unbuilt = build_pure(here, staging)
            requirements = [root, *map(str, roots[1:])]
            items, keep = resolve_target(requirements, roots, target, Path(tmp) / "target.json", staging, unbuilt)
            fetch = [f"{name}=={items[name]['metadata']['version']}" for name in sorted(keep - set(wheels(staging)))]
            progress(f"[4/5] downloading {len(fetch)} wheels")
            options = ["--no-deps", "--quiet", "-d", str(staging), *target.pip_options()]
            pip("download", *options, *fetch, what="downloading")
        for name, wheel in wheels(staging).items():  # a sdist's wheel the target turned out not to need
            if name not in keep:
                wheel.unlink()
        requires = items["distrain"]["metadata"]["requires_dist"]
        torch = next((r for r in requires if canonicalize_name(Requirement(r).name) == EXCLUDED), EXCLUDED)
        progress("[5/5] writing " + NOTE)
        (staging / NOTE).write_text(note(out, target, spec, torch))
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return install_line(out, f"distrain{spec}")


def own_wheel(out: Path) -> Path:
    """distrain's wheel, built by this environment's setuptools (no isolated environment to fetch it into);
    setuptools' scratch folder, build/, is not left in the checkout."""
    had_build = (ROOT / "build").exists()
    pip("wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out), str(ROOT), what="building distrain")
    if not had_build:
        shutil.rmtree(ROOT / "build", ignore_errors=True)
    (wheel,) = out.glob("distrain-*.whl")
    return wheel


def resolve_target(
    requirements: list[str], roots: list[Requirement], target: Target, report: Path, links: Path, unbuilt: list[str]
) -> tuple[dict[str, dict], set[str]]:
    """pip's resolution for the target, with the wheels in `links`, and the names to keep; requirements whose
    markers hold on the target only are added and resolved again (a bounded loop). A failure names the
    sdists that made no pure wheel here (`unbuilt`): the likely cause."""
    for _ in range(3):
        progress(f"[3/5] resolving for {target} (metadata only)")
        try:
            options = ["--find-links", str(links), *target.pip_options()]
            items = resolve(requirements, report, *options, what=f"resolving for {target}")
        except WheelhouseError as e:
            if unbuilt:
                hint = f"no wheel of {'; '.join(unbuilt)}: build it on a machine like the target"
                raise WheelhouseError(f"{e}; {hint}") from None
            raise
        keep, missing = needed(items, roots, target.markers())
        if not missing:
            return items, keep
        progress(f"{', '.join(missing)}: required on the target only; resolving again")
        requirements = [*requirements, *missing]
    raise WheelhouseError(f"{target}: {', '.join(missing)} still unresolved after 3 tries")


def wheels(folder: Path) -> dict[str, Path]:
    """The wheels in `folder`, by project name."""
    return {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in folder.glob("*.whl")}


def install_line(folder: Path, what: str, editable: bool = False) -> str:
    """The offline install of `what` (a requirement, or a checkout if editable) from the wheelhouse `folder`."""
    quoted = f"'{what}'" if "[" in what else what
    return f"python -m pip install --no-index --find-links {folder.resolve()} {'-e ' if editable else ''}{quoted}"


def note(folder: Path, target: Target, spec: str, torch: str) -> str:
    """INSTALL.txt: what the folder is for and the commands."""
    return f"""distrain{spec} and every package it needs except torch, as wheels for {target}
(made {time.strftime("%Y-%m-%d")}). Install with no package index, into a Python that already has torch
({torch}): the image's own python, or a venv made with `python -m venv --system-site-packages` on top
of it. If this folder has moved, give its new path.

    {install_line(folder, f"distrain{spec}")}

It installs the `distrain` command and its presets. From a distrain checkout, the editable install `make setup` makes:

    {install_line(folder, f".{spec}", editable=True)}
"""


def main(argv: list[str] | None = None) -> int:
    from distrain.commands import how

    parser = argparse.ArgumentParser(prog=how("wheelhouse"), description=__doc__.split("\n")[0])
    parser.add_argument("--python", default="", help="target CPython version, e.g. 3.12 (default: this one)")
    parser.add_argument("--platform", default="", help="target manylinux tag (default: this machine's)")
    parser.add_argument("--extras", default="", help="distrain extras to include, comma-separated, e.g. hf")
    parser.add_argument("--out", default="", help="the folder to write (default wheelhouse-cp312-<platform>)")
    args = parser.parse_args(argv)
    started = time.time()
    try:
        python = args.python or ".".join(map(str, sys.version_info[:2]))
        target = Target.of(python, args.platform or this_platform())
        extras = [e.strip() for e in args.extras.split(",") if e.strip()]
        out = Path(args.out or target.folder())
        line = build(out, target, extras)
    except WheelhouseError as e:
        print(f"wheelhouse: error: {e}", file=sys.stderr)
        return 2
    made = list(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in made) / 2**20
    progress(f"{len(made)} wheels, {size:.0f} MiB in {out}/ ({time.time() - started:.0f} s). Offline install:")
    print(line)
    return 0
