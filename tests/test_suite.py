"""The suite's own guards: a fixture that hangs in its setup fails on its own bound (conftest.FIXTURE_TIMEOUT_S),
which pytest-timeout's per-test limits no longer cover."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO

SLOW = """
import time

import conftest
import pytest

conftest.FIXTURE_TIMEOUT_S = 1


@pytest.fixture
def slow():
    time.sleep(30)


def test_with_a_slow_fixture(slow):
    pass
"""


def test_a_fixture_that_overruns_its_setup_bound_fails_there(tmp_path: Path):
    (tmp_path / "test_slow.py").write_text(SLOW)
    env = {"PYTHONPATH": str(REPO / "tests"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 1 and "fixture 'slow' took over 1 s to set up" in done.stdout, done.stdout[-2000:]
