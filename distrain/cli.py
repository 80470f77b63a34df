"""Hydra's side of the command line: the schema's registration, the one `compose`, and the checks and
rewrites `jobs/train.py` applies to its arguments before Hydra parses them.

`compose(overrides)` is the one way to build a config outside the entrypoint: tests and benchmarks
get exactly the config `jobs/train.py` would train.
"""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

from distrain.config import TrainConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
SCHEMA = "train_schema"  # the name conf/train.yaml's defaults list gives TrainConfig
_GROUP_CHOICE = re.compile(r"^(\w+)=([\w.-]+)$")
# A plan writes nothing: Hydra's record and log stay out of the run directory (and off the disk).
PLAN_HYDRA_OVERRIDES = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout"]
ALIASES = {"checkpoint.async": "checkpoint.async_save"}  # command-line name → the field it sets


def register() -> None:
    """Give Hydra the typed schema conf/ composes onto (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA, node=TrainConfig)


def compose(overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The config `python jobs/train.py *overrides` trains, as a TrainConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    overrides = spell_out(overrides)
    check_group_choices(overrides)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(hydra_compose("train", overrides=overrides))


class BadInput(ValueError):
    """An override naming a config-group option that does not exist."""


def check_group_choices(overrides: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Catch `model=nope` with a one-line error before Hydra prints its page-long one."""
    for arg in overrides:
        match = _GROUP_CHOICE.match(arg)
        if not match or not (conf_dir / match[1]).is_dir():
            continue
        group, choice = match[1], match[2]
        if not (conf_dir / group / f"{choice}.yaml").exists():
            known = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
            raise BadInput(f"unknown {group} {choice!r} ({arg}); choose one of: {', '.join(known)}")


def plan_overrides(args: list[str]) -> list[str]:
    """`--plan` is the override `plan=true`; either one also keeps Hydra from writing its record. Public
    names that no dataclass field can have become the field's (`spell_out`)."""
    args = ["plan=true" if a == "--plan" else a for a in spell_out(args)]
    return [*args, *PLAN_HYDRA_OVERRIDES] if "plan=true" in args else args


def spell_out(args: list[str] | tuple[str, ...]) -> list[str]:
    """`checkpoint.async=…` sets the field `checkpoint.async_save`: `async` is a Python keyword."""
    return [ALIASES[a.partition("=")[0]] + a[a.index("=") :] if a.partition("=")[0] in ALIASES else a for a in args]
