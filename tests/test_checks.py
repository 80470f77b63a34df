"""Every check in distrain/ (a raise, a require that refuses the config) is in tests/checks.txt as `make coverage`
measured it last, fired by a test or unfired with the reason none can fire it: a check added since shows up
here, in CI, until it is measured. And the checker finds what it should, and reads a real measurement."""

from __future__ import annotations

import textwrap
from pathlib import Path

import coverage
from checks import all_checks, checks_in, fired, read_ledger, record_fired_requires

HOW = "run `make coverage` (it rewrites tests/checks.txt); give each unfired check a test, or its reason there"


def test_every_check_is_measured_and_every_unfired_one_says_why():
    ledger, names = read_ledger(), [c.name for c in all_checks()]
    new = [n for n in names if n not in ledger]
    assert not new, f"{len(new)} checks not measured yet ({HOW}): {new[:5]}"
    gone = sorted(set(ledger) - set(names))
    assert not gone, f"{len(gone)} checks in tests/checks.txt are no longer in distrain/ ({HOW}): {gone[:5]}"
    unexplained = [n for n, (status, why) in ledger.items() if status == "unfired" and why in (None, "?")]
    assert not unexplained, f"{len(unexplained)} unfired checks without a reason ({HOW}): {unexplained[:5]}"


MODULE = """
    from distrain.strategy.parallelism import require


    def check(x):
        require(x > 0, f"x={x}: must be positive")
        if x > 9:
            raise ValueError("too big")
        try:
            return 1 / (x - 5)
        except ZeroDivisionError:
            raise


    class Box:
        def open(self, x):
            if x:
                raise ValueError("too big")
            raise ValueError("too big")
"""


def test_the_checker_names_each_raise_and_refusal_by_its_place(tmp_path: Path):
    (tmp_path / "mod.py").write_text(textwrap.dedent(MODULE))
    assert [(c.name, c.first) for c in checks_in(tmp_path / "mod.py", tmp_path)] == [
        ('mod.py:check: require: f"x={x}: must be positive"', 6),
        ('mod.py:check: ValueError("too big")', 8),  # the bare `raise` passes a failure on: not a check
        ('mod.py:Box.open: ValueError("too big")', 18),
        ('mod.py:Box.open: ValueError("too big") #2', 19),
    ]


def test_a_measurement_says_which_checks_fired(tmp_path: Path, monkeypatch):
    """A real coverage.py measurement of the module above, and the refusals recorded as make coverage records them."""
    import importlib
    import sys

    from distrain.strategy import parallelism

    (tmp_path / "mod.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    check_before = parallelism.require
    plain = record_fired_requires(str(tmp_path / "requires"))
    try:
        sys.modules.pop("mod", None)
        cov = coverage.Coverage(data_file=str(tmp_path / "data"), include=[str(tmp_path / "mod.py")], config_file=False)
        cov.start()
        mod = importlib.import_module("mod")
        for x, error in ((0, Exception), (10, ValueError), (1, None)):
            try:
                mod.check(x)
            except Exception as e:
                assert error is not None and isinstance(e, error)
        cov.stop()
        cov.save()
    finally:
        plain()
        sys.modules.pop("mod", None)
    assert parallelism.require is check_before
    checks = checks_in(tmp_path / "mod.py", tmp_path)
    assert fired(checks, str(tmp_path / "data"), tmp_path / "requires", tmp_path) == {c.name for c in checks[:2]}


def test_every_mutant_still_finds_its_bug_and_its_tests():
    """tests/mutants.py stays runnable: each bug's text occurs once in its file, and each test it names exists."""
    from mutants import MUTANTS, REPO

    for m in MUTANTS:
        assert (REPO / m.file).read_text().count(m.old) == 1, m.name
        for test in m.tests:
            path, _, name = test.partition("::")
            assert f"def {name.split('[')[0]}(" in (REPO / path).read_text(), (m.name, test)
