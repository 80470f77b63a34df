"""Loaded by every Python process `make coverage` starts (this folder is on their PYTHONPATH), after
coverage.py's own start-up hook has begun measuring it:

- A process that ends without running its exit handlers (Ray ends its workers from outside) would lose what
  was measured in it: it saves every SAVE_S seconds instead, on a thread of its own.
- A `require` that refuses the config runs the same line as one that passes: each refusal appends its caller's
  file and line to $DISTRAIN_FIRED_REQUIRES, for tests/checks.py."""

import os
import sys
import threading
import time

SAVE_S = 2.0


def _save_every(cov) -> None:
    while True:
        time.sleep(SAVE_S)
        cov.save()


if os.environ.get("COVERAGE_PROCESS_CONFIG"):
    try:
        import coverage
    except ImportError:
        coverage = None
    current = coverage and coverage.Coverage.current()
    if current is not None:
        threading.Thread(target=_save_every, args=(current,), name="coverage-save", daemon=True).start()

if os.environ.get("DISTRAIN_FIRED_REQUIRES"):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "distrain_checks", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checks.py")
    )
    checks = sys.modules["distrain_checks"] = importlib.util.module_from_spec(spec)  # a dataclass looks itself up
    spec.loader.exec_module(checks)
    try:
        checks.record_fired_requires(os.environ["DISTRAIN_FIRED_REQUIRES"])
    except ImportError:  # a Python without distrain (a fresh venv a test makes)
        pass
