"""Hydra's side of the command line: the schema's registration, the one `compose`, and the checks and
rewrites `distrain train` (jobs/train.py) applies to its arguments before Hydra parses them.

`compose(overrides)` is the one way to build a config outside the entrypoint: tests and benchmarks
get exactly the config `distrain train` would train. The presets are package data (CONF_DIR); a user's own
are found in a directory given with Hydra's `--config-dir` (`config_dirs`), searched after the shipped ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from pathlib import Path

from omegaconf import OmegaConf

from distrain.config import TrainConfig

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # the presets, package data (the checkout's conf/ links here)
SCHEMA = "train_schema"  # the name conf/train.yaml's defaults list gives TrainConfig
# Command-line name → the field it sets.
ALIASES = {"checkpoint.async": "checkpoint.async_save", "cluster.policy._target_": "cluster.policy"}


def register() -> None:
    """Give Hydra the typed schema conf/ composes onto (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA, node=TrainConfig)


def compose(overrides: list[str] | tuple[str, ...] = (), config_dir: str | Path | None = None) -> TrainConfig:
    """The config `distrain train [--config-dir config_dir] *overrides` trains, as a TrainConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    dirs = config_dirs(["--config-dir", str(config_dir)]) if config_dir else (CONF_DIR,)
    overrides = spell_out(overrides)
    check_overrides(overrides, dirs)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(hydra_compose("train", overrides=[*overrides, *searchpath(dirs)]))


def config_dirs(argv: list[str]) -> tuple[Path, ...]:
    """Where the presets are, in Hydra's order: the shipped ones, then the user's `--config-dir` (Hydra searches
    it after them, so a user's preset has a name of its own). A directory that is not there: one line."""
    from hydra._internal.utils import get_args_parser

    given = get_args_parser().parse_known_args(argv)[0].config_dir
    if given is None:
        return (CONF_DIR,)
    if not Path(given).is_dir():
        raise BadInput(f"--config-dir {given}: no such directory (it holds your presets, e.g. {given}/model/mine.yaml)")
    return CONF_DIR, Path(given).resolve()


def searchpath(dirs: tuple[Path, ...]) -> list[str]:
    """The override that has Hydra's compose API search `dirs` beyond CONF_DIR, as `--config-dir` has hydra.main."""
    extra = [f"'file://{d}'" for d in dirs if d != CONF_DIR]
    return [f"hydra.searchpath=[{','.join(extra)}]"] if extra else []


def is_group(key: str, dirs: tuple[Path, ...] = (CONF_DIR,)) -> bool:
    """`key` names a config group (model, strategy, …) in one of the preset directories."""
    return any((d / key).is_dir() for d in dirs)


def options(group: str, dirs: tuple[Path, ...] = (CONF_DIR,)) -> list[str]:
    """The presets of `group` in every preset directory, sorted."""
    return sorted({p.stem for d in dirs for p in (d / group).glob("*.yaml")})


class BadInput(ValueError):
    """An override naming a config-group option or key that does not exist, or a value of the wrong type."""


def check_overrides(overrides: list[str] | tuple[str, ...], dirs: tuple[Path, ...] = (CONF_DIR,)) -> None:
    """Every override in one line each before Hydra reads them: a group option that exists, a key the
    schema has (with or without `+`; below a free-form dict such as cluster.env_vars, any key), and a
    value (each of a sweep's) of the key's type. Hydra would add an unknown `+key` silently and answer a
    wrong type with a page."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(TrainConfig)
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as e:
        raise BadInput(
            str(e).splitlines()[0]
            + """ (an override is key=value; quote a value with characters Hydra reserves: "key='value'")"""
        ) from None
    check_hydra_keys(parsed)
    for override in parsed:
        key = override.key_or_group
        if re.split(r"[./]", key)[0] == "hydra" or override.is_delete():
            continue  # Hydra's own settings: check_hydra_keys
        values = sweep_values(override, dirs) if override.is_sweep_override() else [override.value()]
        if is_group(key, dirs):
            check_group_choice(key, values, override.input_line, dirs)
            continue
        kind = field_type(key)
        if kind is None:
            raise BadInput(unknown_key(key))
        if kind is dict:
            continue
        for value in values:
            try:
                OmegaConf.update(schema, key, value, merge=True)
            except OmegaConfBaseException:
                integers = kind is int and "interval(" in override.input_line
                hint = "; int(interval(a,b)) samples integers" if integers else ""
                raise BadInput(f"{override.input_line}: {key} takes {type_name(kind)}, not {value!r}{hint}") from None


def check_hydra_keys(parsed: list) -> None:
    """A key of Hydra's own settings that Hydra's config lacks (hydra.sweeper.n_trial), in one line naming the
    one meant, instead of Hydra's page suggesting to add it with `+`: in Hydra's config as the given `hydra/`
    choices (hydra/sweeper=optuna) compose it, else in another option of its group (the sweeper that has it).
    Below a free-form dict (hydra.job.env_set) any key goes, added with `+`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import DictConfig

    own = [o for o in parsed if o.key_or_group.startswith("hydra.") and not o.is_delete()]
    if not own or GlobalHydra.instance().is_initialized():  # none, or a compose under way: Hydra says
        return
    choices = [o.input_line for o in parsed if o.key_or_group.startswith("hydra/")]

    def composed(group: str = "", option: str = "") -> typing.Any:
        """Hydra's config with the given choices, or with `option` for `group`; None if Hydra refuses them."""
        chosen = [c for c in choices if not c.startswith(f"{group}=")] + [f"{group}={option}"] * bool(group)
        try:
            return hydra_compose("train", overrides=chosen, return_hydra_config=True)
        except Exception:  # a choice Hydra refuses: its own error names it
            return None

    def meant(key: str, node: typing.Any) -> str | None:
        parent = key.rpartition(".")[0]
        return closest(key, [f"{parent}.{k}" for k in node]) if isinstance(node, DictConfig) else None

    register()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        options = GlobalHydra.instance().config_loader().get_group_options
        for override in own:
            here, parent, line = composed(), "", override.input_line
            for name in override.key_or_group.split("."):
                if not isinstance(here, DictConfig):
                    break  # a choice Hydra refuses, or below a value: Hydra says
                key = f"{parent}.{name}".lstrip(".")
                if name in here:
                    parent, here = key, here[name]
                elif OmegaConf.get_type(here) is dict:  # a free-form dict: any key, added with `+`
                    if override.is_add():
                        break
                    raise BadInput(f"{line}: {parent} has no key {name} yet: add it, +{line}")
                else:
                    group = parent.replace(".", "/")
                    found = meant(key, here)
                    for option in [] if found else options(group):
                        if other := meant(key, OmegaConf.select(composed(group, option), parent)):
                            found = f"{other} (with {group}={option})"
                            break
                    keys = ", ".join(str(k) for k in here if not str(k).startswith("_"))
                    hint = f"did you mean {found}?" if found else f"{parent} has {keys}"
                    raise BadInput(f"unknown key {override.key_or_group}; {hint}")


def sweep_values(override: typing.Any, dirs: tuple[Path, ...] = (CONF_DIR,)) -> list:
    """What of a sweep can be checked before it runs: each value of a choice or a range, the options of
    its group a glob matches, an interval's bounds (a sampler such as Optuna's picks values between them)."""
    from hydra.core.override_parser.types import Glob, IntervalSweep

    value, line = override.value(), override.input_line
    if isinstance(value, IntervalSweep):
        if not value.start < value.end:
            raise BadInput(f"{line}: an interval's start must be below its end")
        return [value.start, value.end]
    if isinstance(value, Glob):
        if not is_group(override.key_or_group, dirs):
            raise BadInput(f"{line}: glob() sweeps the options of a config group, and {override.key_or_group} is none")
        known = options(override.key_or_group, dirs)
        if not value.filter(known):
            raise BadInput(f"{line} matches none of {override.key_or_group}'s options: {', '.join(known)}")
        return value.filter(known)
    return list(override.sweep_iterator())


def field_type(key: str, cls: type = TrainConfig) -> typing.Any:
    """The type of the schema's field at dotted `key`; `dict` for any key below a free-form dict; None if
    the schema has no such key."""
    head, _, rest = key.partition(".")
    hints = typing.get_type_hints(cls)
    if head not in hints:
        return None
    kind = hints[head]
    if dataclasses.is_dataclass(kind):
        return field_type(rest, kind) if rest else kind
    if typing.get_origin(kind) is dict:
        return dict
    return None if rest else kind


def schema_keys(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, groups and fields."""
    keys = []
    for name, kind in typing.get_type_hints(cls).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(kind):
            keys += schema_keys(kind, f"{prefix}{name}.")
    return keys


def unknown_key(key: str) -> str:
    """The line for a key the schema lacks, naming the one meant (`closest`), else a key of that name in another
    section (trainer.lr: optim.lr), else the closest key anywhere."""
    keys, name = schema_keys(), key.rpartition(".")[2]
    elsewhere = [k for k in keys if k.rpartition(".")[2] == name] + difflib.get_close_matches(
        key, keys, n=1, cutoff=0.6
    )
    meant = closest(key, keys) or next(iter(elsewhere), None)
    hint = f"did you mean {meant}?" if meant else "`distrain train --cfg job` prints every key"
    return f"unknown key {key}; {hint}"


def closest(key: str, keys: list[str]) -> str | None:
    """The key of its section in `keys` that the dotted `key` meant: the one named by its name's initials
    (strategy.context_parallel: strategy.cp), else the closest name; None when none is close."""
    section, _, name = key.rpartition(".")
    names = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == section}
    initials = "".join(word[0] for word in name.split("_") if word)
    meant = [initials] if len(initials) > 1 and initials in names else []
    close = meant or difflib.get_close_matches(name, [n for n in names if not n.startswith("_")], n=1, cutoff=0.6)
    return names[close[0]] if close else None


def type_name(kind: typing.Any) -> str:
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")


def check_group_choice(group: str, choices: list, line: str, dirs: tuple[Path, ...] = (CONF_DIR,)) -> None:
    """`model=nope` in one line, before Hydra prints its page-long error."""
    for choice in choices:
        if not any((d / group / f"{choice}.yaml").exists() for d in dirs):
            raise BadInput(f"unknown {group} {choice!r} ({line}); choose one of: {', '.join(options(group, dirs))}")


def overrides_of(argv: list[str]) -> list[str]:
    """The overrides among `distrain train`'s arguments, without Hydra's flags (`--cfg job`, `-m`, ...)."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_known_args(argv)[0].overrides


def check_flags(argv: list[str]) -> None:
    """An argument Hydra has no flag for (`--strategy=zero3`, `--steps 5`) in one line, naming the override
    meant, instead of Hydra's usage page."""
    from hydra._internal.utils import get_args_parser

    from distrain.commands import how

    unknown = [a for a in get_args_parser().parse_known_args(argv)[1] if a.startswith("-")]
    if not unknown:
        return
    arg = unknown[0]
    key, eq, value = arg.lstrip("-").partition("=")
    if field_type(key) is not None or is_group(key):
        meant = f"{key}={value}" if eq else f"{key}=…"
        raise BadInput(f"{arg}: overrides take no dashes; write {meant}")
    raise BadInput(f"{arg} is not an option: `{how('train')} --help` lists the commands, and overrides are key=value")


def plan_overrides(args: list[str]) -> list[str]:
    """`--plan` is the override `plan=true` (which, like any run, Hydra writes nothing for: conf/train.yaml
    keeps its record and log out of the working directory). Public names that no dataclass field can have
    become the field's (`spell_out`)."""
    return ["plan=true" if a == "--plan" else a for a in spell_out(args)]


def spell_out(args: list[str] | tuple[str, ...]) -> list[str]:
    """`checkpoint.async=…` sets the field `checkpoint.async_save` (`async` is a Python keyword), and
    `cluster.policy._target_=…` the field `cluster.policy` (a user's class is named as a model is). A value
    that starts with `~` (`data.path=~/corpus`) is the home directory, as the shell would have expanded it in
    an assignment: Hydra's grammar has no `~` in values, and the shell leaves `key.sub=~/x` alone."""
    spelled = []
    for arg in args:
        key, sep, value = arg.partition("=")
        key = ALIASES.get(key, key)
        if sep and not key.startswith("~") and re.match(r"~[\w.-]*(/|$)", value):
            value = os.path.expanduser(value)
        spelled.append(key + sep + value)
    return spelled
