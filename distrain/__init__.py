"""distrain: distributed training on Ray with PyTorch's own parallelism building blocks."""

from __future__ import annotations

from pathlib import Path


def _version() -> str:
    """pyproject.toml's version, said there only: a checkout's own file when this package is one (an editable
    install's metadata is as old as its last `pip install`, and `ray job submit --working-dir` ships the
    checkout), else the installed distribution's metadata."""
    import importlib.metadata
    import tomllib

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if project.get("name") == "distrain":
            return project["version"]
    try:
        return importlib.metadata.version("distrain")
    except importlib.metadata.PackageNotFoundError:  # a copy of the package with neither: say so, not a guess
        return "0+unknown"


__version__ = _version()
