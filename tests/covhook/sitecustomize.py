"""Loaded by every Python process `make coverage` starts (this folder is on their PYTHONPATH), after
coverage.py's own start-up hook has begun measuring it:

- A process that ends without running its exit handlers (Ray ends its workers from outside) would lose what
  was measured in it: it saves every SAVE_S seconds instead, on a thread of its own.
- Ray runs the methods of an actor with max_concurrency > 1 (distrain's worker: `run` beside `progress`) on
  threads it makes itself, which coverage's tracer, set per thread through `threading`, never reaches: each
  actor method installs it in its thread first.
- A `require` that refuses the config runs the same line as one that passes: each refusal appends its caller's
  file and line to $DISTRAIN_FIRED_REQUIRES, for tests/checks.py."""

import importlib.abc
import importlib.util
import os
import sys
import threading
import time

SAVE_S = 2.0


def _save_every(cov) -> None:
    while True:
        time.sleep(SAVE_S)
        cov.save()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once the module `name` has been imported (executed), whoever imports it."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run, then = spec.loader.exec_module, self.then

        def exec_module(module):
            run(module)
            then(module)

        spec.loader.exec_module = exec_module
        return spec


def _trace_actor_threads(collector):
    def patch(function_manager):
        manager = function_manager.FunctionActorManager
        make = manager._make_actor_method_executor

        def traced_executor(self, method_name, method):
            executor = make(self, method_name, method)

            def traced(*args, **kwargs):
                if sys.gettrace() is None:  # a thread of Ray's own: coverage's tracer is not in it yet
                    sys.settrace(collector._installation_trace)
                return executor(*args, **kwargs)

            traced.name, traced.method = executor.name, executor.method
            return traced

        manager._make_actor_method_executor = traced_executor

    sys.meta_path.insert(0, _AfterImport("ray._private.function_manager", patch))


if os.environ.get("COVERAGE_PROCESS_CONFIG"):
    try:
        import coverage
    except ImportError:
        coverage = None
    current = coverage and coverage.Coverage.current()
    if current is not None:
        threading.Thread(target=_save_every, args=(current,), name="coverage-save", daemon=True).start()
        _trace_actor_threads(current._collector)

if os.environ.get("DISTRAIN_FIRED_REQUIRES"):
    spec = importlib.util.spec_from_file_location(
        "distrain_checks", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checks.py")
    )
    checks = sys.modules["distrain_checks"] = importlib.util.module_from_spec(spec)  # a dataclass looks itself up
    spec.loader.exec_module(checks)
    try:
        checks.record_fired_requires(os.environ["DISTRAIN_FIRED_REQUIRES"])
    except ImportError:  # a Python without distrain (a fresh venv a test makes)
        pass
