"""The architecture's one hard rule: the Ray layer and the torch.distributed layer never meet."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO


def imported_modules(folder: Path) -> set[str]:
    names = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
    return names


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("cluster", ("torch", "distrain.parallel", "distrain.model", "distrain.train")),
        ("parallel", ("ray", "distrain.cluster", "distrain.launch")),
    ],
)
def test_layers_do_not_import_each_other(layer: str, forbidden: tuple[str, ...]):
    imports = imported_modules(REPO / "distrain" / layer)
    offending = sorted(m for m in imports if any(m == f or m.startswith(f + ".") for f in forbidden))
    assert not offending, f"distrain/{layer} imports {offending}"
