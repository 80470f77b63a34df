"""From `model._target_` to a model keeping the contract (contract.py), or a one-line ConfigError.

`model=<name>` presets (conf/model/) name a shipped family's target; `model._target_=pkg.module.fn`
names a user's own class or function, imported as Python imports anything: from `sys.path`, which
holds the working directory and PYTHONPATH (the cluster passes the driver's to its workers).
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from distrain.config import ConfigError, ModelConfig
from distrain.model.families import FAMILIES, shipped


def resolve(target: str) -> Callable[..., Any]:
    """The class or function `target` names (a dotted path), or a ConfigError saying why not."""
    _add_pythonpath()
    module_name, _, attr = target.rpartition(".")
    key = f"model._target_={target}"
    if not module_name:
        raise ConfigError(f"{key}: not a dotted path pkg.module.name; shipped: {', '.join(FAMILIES)}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise ConfigError(f"{key}: importing {module_name} failed: {e}") from None
        close = difflib.get_close_matches(target, FAMILIES, n=1)
        hint = f"did you mean {close[0]}?" if close else f"shipped: {', '.join(FAMILIES)};"
        raise ConfigError(
            f"{key}: no module named {e.name}; {hint} a module of your own must be importable: run from "
            f"its directory or put that directory on PYTHONPATH"
        ) from None
    except Exception as e:  # the user's module itself fails to import
        raise ConfigError(f"{key}: importing {module_name} failed: {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f"did you mean {module_name}.{close[0]}?" if close else f"shipped: {', '.join(FAMILIES)}"
        raise ConfigError(f"{key}: {module_name} has no attribute {attr}; {hint}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ConfigError(
            f"{key}: {target} is a {type(fn).__name__}, not a class or function to call (cfg, max_seq_len, seed)"
        )
    return fn


def _add_pythonpath() -> None:
    """PYTHONPATH's directories on sys.path even when it was set after this process started: a Ray
    worker receives its environment (cluster.env_vars, what the driver forwards) once running."""
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and entry not in sys.path:
            sys.path.append(entry)


def build_model(cfg: ModelConfig, max_seq_len: int, seed: int = 0) -> Any:
    """`cfg._target_(cfg, max_seq_len, seed)`, checked against the contract. Under `with
    torch.device("meta")` it allocates nothing (the layout materialises it)."""
    from distrain.model.contract import missing_part

    model = resolve(cfg._target_)(cfg, max_seq_len, seed)
    missing = missing_part(model)
    if missing is not None:
        raise ConfigError(f"model._target_={cfg._target_}: the model lacks {missing} (see distrain/model/contract.py)")
    return model


def check_model(cfg: ModelConfig, max_seq_len: int) -> None:
    """The driver's check before any worker starts: a shipped family needs none (and no torch import);
    a user's target is imported and built on the meta device, which costs no memory."""
    if shipped(cfg._target_) is None:
        meta_model(cfg, max_seq_len)


def has_plan(cfg: ModelConfig, max_seq_len: int, mode: str) -> bool:
    """Whether the model has a tensor-parallel plan for strategy.tp_mode=`mode`: `tp_plan` (1d) or
    `grid_tp_plan` (2d, 2.5d, 3d) not None."""
    family = shipped(cfg._target_)
    if family is not None:
        return family.tp if mode == "1d" else family.grid_tp and not cfg.tie_embeddings
    model = meta_model(cfg, max_seq_len)
    return (model.tp_plan(True) if mode == "1d" else model.grid_tp_plan()) is not None


def meta_model(cfg: ModelConfig, max_seq_len: int) -> Any:
    """The model built on the meta device: its shape and methods, no memory."""
    import torch

    with torch.device("meta"):
        return build_model(cfg, max_seq_len)
