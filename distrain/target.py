"""A user's code named in the config by a dotted path (`model._target_`, `cluster.policy._target_`),
imported as Python imports anything: from `sys.path`, which holds the working directory and PYTHONPATH
(the cluster passes the driver's to its workers). Neither torch nor Ray: the driver checks targets
before anything starts."""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Collection
from typing import Any

from distrain.config import ConfigError


def import_target(target: str, key: str, shipped: Collection[str]) -> Any:
    """What `target` (pkg.module.name) names, or a one-line ConfigError that starts `key=target` and
    points at the closest of `shipped` (what distrain itself offers for that key)."""
    _add_pythonpath()
    module_name, _, attr = target.rpartition(".")
    key = f"{key}={target}"
    if not module_name:
        raise ConfigError(f"{key}: not a dotted path pkg.module.name; shipped: {', '.join(shipped)}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise ConfigError(f"{key}: importing {module_name} failed: {e}") from None
        close = difflib.get_close_matches(target, shipped, n=1)
        hint = f"did you mean {close[0]}?" if close else f"shipped: {', '.join(shipped)};"
        raise ConfigError(
            f"{key}: no module named {e.name}; {hint} a module of your own must be importable: run from "
            f"its directory or put that directory on PYTHONPATH"
        ) from None
    except Exception as e:  # the user's module itself fails to import
        raise ConfigError(f"{key}: importing {module_name} failed: {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f"did you mean {module_name}.{close[0]}?" if close else f"shipped: {', '.join(shipped)}"
        raise ConfigError(f"{key}: {module_name} has no attribute {attr}; {hint}")
    return getattr(module, attr)


def _add_pythonpath() -> None:
    """PYTHONPATH's directories on sys.path even when it was set after this process started: a Ray
    worker receives its environment (cluster.env_vars, what the driver forwards) once running."""
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and entry not in sys.path:
            sys.path.append(entry)
