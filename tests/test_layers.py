"""Every "never" of docs/architecture.md's picture, checked transitively: a module's imports are followed through
every distrain module it reaches (function-level imports included), so a rule cannot be broken by
going round it. And the driver, at run time, has not imported torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "distrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


@cache
def direct_imports(module: str) -> frozenset[str]:
    """Every module a distrain module's code names in an import, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return frozenset(names)


def reached(start: str, door: str | None = None) -> set[str]:
    """All modules `start` imports, directly or through the distrain modules it imports (not through `door`)."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        for name in direct_imports(module):
            if name in seen:
                continue
            seen.add(name)
            if name in MODULES and name != door:
                todo.append(name)
    return seen


def under(names: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))


RULES = {
    # The Ray layer knows nothing of torch, models, parallelism or training.
    "distrain.cluster": (
        "torch",
        "distrain.parallel",
        "distrain.model",
        "distrain.train",
        "distrain.ps",
        "distrain.driver",
    ),
    # The torch.distributed layer knows nothing of Ray, the driver or the parameter server.
    "distrain.parallel": ("ray", "distrain.cluster", "distrain.driver", "distrain.ps", "distrain.train"),
    # One rank's training does not know it runs under Ray.
    "distrain.train": ("ray", "distrain.cluster", "distrain.driver", "distrain.ps"),
    # The model is a model: no parallelism of ours, no Ray, no training loop.
    "distrain.model": (
        "ray",
        "distrain.cluster",
        "distrain.parallel",
        "distrain.train",
        "distrain.ps",
        "distrain.driver",
    ),
    # The run directory's files are written by the driver and the ranks alike, knowing neither.
    "distrain.storage": (
        "ray",
        "distrain.cluster",
        "distrain.driver",
        "distrain.parallel",
        "distrain.train",
        "distrain.ps",
    ),
    # Data is read by the ranks and prepared by its own job: neither knows the driver, Ray or training.
    "distrain.data": (
        "ray",
        "distrain.cluster",
        "distrain.driver",
        "distrain.parallel",
        "distrain.train",
        "distrain.ps",
    ),
    # What the driver checks and prints before anything starts needs neither torch nor Ray; the config is the ground
    # every layer stands on, so it imports none of them (only pure text: distrain.urls, distrain.redaction).
    "distrain.config": (
        "torch",
        "ray",
        "distrain.storage",
        "distrain.data",
        "distrain.model",
        "distrain.strategy",
        "distrain.cluster",
        "distrain.parallel",
        "distrain.train",
        "distrain.ps",
        "distrain.driver",
    ),
    "distrain.strategy": ("torch", "ray", "distrain.driver"),
    "distrain.driver.validation": ("torch", "ray"),
    "distrain.driver.plan": ("torch", "ray"),
    "distrain.channel": ("torch", "ray"),
    "distrain.progress": ("torch", "ray"),
}


@pytest.mark.parametrize(("layer", "forbidden"), RULES.items(), ids=list(RULES))
def test_a_layer_never_reaches_what_it_must_not_know(layer: str, forbidden: tuple[str, ...]):
    modules = [m for m in MODULES if m == layer or m.startswith(layer + ".")]
    assert modules, layer
    door = USER_MODEL_DOOR if layer in DRIVER_LAYERS else None
    offending = {m: under(reached(m, door), forbidden) for m in modules}
    assert not any(offending.values()), {m: names for m, names in offending.items() if names}


# The driver checks a user's model (model._target_ outside distrain) by importing and building it on the
# meta device, which needs torch; the registry is the one way there, taken only for such a target (a
# shipped family's check and size need no torch: test_the_driver_imports_no_torch runs the driver).
USER_MODEL_DOOR = "distrain.model.registry"
DRIVER_LAYERS = ("distrain.driver.validation", "distrain.driver.plan")


def test_no_module_of_the_product_reaches_the_test_bed():
    """distrain/testing/ (namespace hosts, an object store, process helpers) is for the tests and benchmarks only."""
    product = [m for m in MODULES if not (m == "distrain.testing" or m.startswith("distrain.testing."))]
    offending = {m: under(reached(m), ("distrain.testing",)) for m in product}
    assert not any(offending.values()), {m: names for m, names in offending.items() if names}


def test_the_parameter_server_uses_parallel_only_through_the_learner():
    """ps/ → train/ (the Learner, whose model has no process group) → parallel/; never parallel/ itself."""
    for module in (m for m in MODULES if m.startswith("distrain.ps")):
        assert not under(set(direct_imports(module)), ("distrain.parallel", "torch.distributed")), module
    assert "distrain.train.learner" in reached("distrain.ps.worker")


def test_the_checker_sees_imports_through_other_modules(tmp_path: Path):
    """The rules are only as good as `reached`: a forbidden import two modules away is found."""
    assert "torch" in reached("distrain.ps.engine")  # engine → metrics → train.optim → torch
    assert "ray" in reached("distrain.driver.launch") and "distrain.cluster.worker" in reached("distrain.driver.launch")


@pytest.mark.timeout(60)
def test_the_driver_imports_no_torch():
    """The driver validates, plans and supervises without torch (a worker loads it, not the driver); the `distrain`
    command and its train, cluster and plot subcommands start without it too."""
    code = (
        "import sys, distrain.driver.cli, distrain.driver.launch, distrain.driver.plan, distrain.driver.validation\n"
        "import distrain.commands, distrain.commands.train, distrain.commands.cluster, distrain.commands.plot\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_design_page_quotes_these_rules():
    """docs/architecture.md quotes RULES as its picture of the layers: the quote and the rules are one text."""
    block = re.compile(r"^RULES = \{\n.*?^\}\n", re.M | re.S)
    here = block.search(Path(__file__).read_text())[0]
    quoted = block.search((REPO / "docs" / "architecture.md").read_text())
    assert quoted and quoted[0] == here, "docs/architecture.md's RULES quote differs from tests/test_layers.py's"
