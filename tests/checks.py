"""The checks of distrain/ and whether a test makes each one fire: every `raise` (a verification, a guard, an
error) and every `require(...)` (a refusal of the config), by a name that survives edits elsewhere in its file.

`make coverage` runs the suite under coverage.py, in every process it starts (Ray workers and spawned ranks
included), and records where `require` refused; then `python tests/checks.py update` writes CHECKS: each check
`fired` or `unfired`, an unfired one with the reason no test can make it fire, which a person writes. The suite's
test_checks.py holds the code to that file without running coverage: a check added, renamed or removed since
the last measurement fails CI until it is measured again (and a test made for it, or its reason written)."""

from __future__ import annotations

import argparse
import ast
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "distrain"
CHECKS = REPO / "tests" / "checks.txt"
FIRED_ENV = "DISTRAIN_FIRED_REQUIRES"  # make coverage: the file each refusing require() call appends its caller to
WHY = " -- why: "


@dataclass(frozen=True)
class Check:
    name: str  # path:function: the raised expression or the require's message, its first line, shortened
    path: str  # relative to the repository
    first: int  # its lines
    last: int


def _short(node: ast.AST, source: str) -> str:
    text = " ".join((ast.get_source_segment(source, node) or "").split())
    return text if len(text) <= 72 else text[:69] + "..."


def _scopes(tree: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """Every node with the qualified name of the function or class it sits in (`<module>` at the top)."""

    def walk(node: ast.AST, scope: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = child.name if scope == "<module>" else f"{scope}.{child.name}"
                yield from walk(child, inner)
            else:
                yield scope, child
                yield from walk(child, scope)

    yield from walk(tree, "<module>")


def checks_in(path: Path, root: Path = REPO) -> list[Check]:
    """The checks of one source file, in order."""
    source = path.read_text()
    rel = path.relative_to(root).as_posix()
    found: list[Check] = []
    seen: dict[str, int] = {}
    for scope, node in _scopes(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:  # a bare `raise` passes a failure on
            what = _short(node.exc, source)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "require":
            if len(node.args) < 2:
                continue
            what = f"require: {_short(node.args[1], source)}"
        else:
            continue
        name = f"{rel}:{scope}: {what}"
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name} #{seen[name]}"
        found.append(Check(name, rel, node.lineno, node.end_lineno or node.lineno))
    return found


def all_checks(package: Path = PACKAGE, root: Path = REPO) -> list[Check]:
    """distrain/testing/ is left out: what the tests start (a test bed, a store) raises on the tests' behalf."""
    paths = [p for p in sorted(package.rglob("*.py")) if p.relative_to(package).parts[0] != "testing"]
    return [c for path in paths for c in checks_in(path, root)]


def read_ledger(path: Path = CHECKS) -> dict[str, tuple[str, str | None]]:
    """CHECKS as name → (status, reason or None)."""
    ledger = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        status, _, rest = line.partition(" ")
        name, _, why = rest.strip().partition(WHY)
        ledger[name] = (status, why.strip() or None)
    return ledger


def record_fired_requires(log: str) -> Callable[[], object]:
    """Wrap distrain's `require`, in every module that has bound it and for those that will, so that each refusal
    appends its caller's file and line to `log`: a require's line runs whether it refuses or not, so coverage
    alone cannot tell. Returns what puts the plain `require` back."""
    from distrain.strategy import parallelism

    check = parallelism.require

    def require(ok: bool, message: str) -> None:
        if not ok:
            caller = sys._getframe(1)
            with open(log, "a") as f:
                f.write(f"{caller.f_code.co_filename}:{caller.f_lineno}\n")
        check(ok, message)

    bound = [m for m in list(sys.modules.values()) if getattr(m, "require", None) is check]  # imported with it
    for module in bound:
        module.require = require
    return lambda: [setattr(module, "require", check) for module in bound]


def fired(checks: list[Check], coverage_file: str, requires_log: Path, root: Path = REPO) -> set[str]:
    """The checks a run fired: a raise whose line coverage saw executed, a require whose call refused."""
    import coverage

    data = coverage.CoverageData(coverage_file)
    data.read()
    executed = {Path(f).resolve(): set(data.lines(f) or ()) for f in data.measured_files()}
    refused: dict[Path, set[int]] = {}
    for line in requires_log.read_text().splitlines() if requires_log.exists() else []:
        file, _, number = line.rpartition(":")
        refused.setdefault(Path(file).resolve(), set()).add(int(number))
    out = set()
    for c in checks:
        path = (root / c.path).resolve()
        lines = refused.get(path, set()) if ": require: " in c.name else executed.get(path, set())
        if any(c.first <= n <= c.last for n in lines):
            out.add(c.name)
    return out


def write_ledger(checks: list[Check], hit: set[str], old: dict[str, tuple[str, str | None]]) -> list[str]:
    """CHECKS rewritten from a measurement, unfired checks keeping their reasons; the unfired without one."""
    lines = [
        "# Every check in distrain/ (a raise, or a require that refuses the config) and whether a test makes it fire,",
        "# as `make coverage` measured it last; an unfired one says why no test can. Regenerated by",
        "# `python tests/checks.py update` after `make coverage`; the reasons are written by hand.",
    ]
    missing = []
    for c in checks:
        if c.name in hit:
            lines.append(f"fired   {c.name}")
            continue
        why = old.get(c.name, ("", None))[1]
        if why is None:
            missing.append(c.name)
        lines.append(f"unfired {c.name}{WHY}{why or '?'}")
    CHECKS.write_text("\n".join(lines) + "\n")
    return missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["update", "list"], help="update CHECKS from a measurement, or list them")
    parser.add_argument("--coverage-file", default=os.environ.get("COVERAGE_FILE", ".coverage"))
    parser.add_argument("--requires", default=os.environ.get(FIRED_ENV, ".coverage-requires"))
    parser.add_argument("--part", action="store_true", help="a part of the suite was measured: what fired before stays")
    args = parser.parse_args()
    checks = all_checks()
    if args.command == "list":
        for c in checks:
            print(f"{c.path}:{c.first}  {c.name}")
        return 0
    hit = fired(checks, args.coverage_file, Path(args.requires))
    old = read_ledger() if CHECKS.exists() else {}
    if args.part:
        hit |= {c.name for c in checks if old.get(c.name, ("",))[0] == "fired"}
    missing = write_ledger(checks, hit, old)
    print(f"{len(hit)} of {len(checks)} checks fired; {len(checks) - len(hit)} unfired, in {CHECKS.relative_to(REPO)}")
    for name in missing:
        print(f"  no reason yet: {name}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
