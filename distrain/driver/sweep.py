"""A Hydra sweep (`jobs/train.py -m optim.lr=1e-3,3e-3`): each point is a run of its own, with its own
run.name (so its own directory and W&B run), run one after another in one driver on one Ray cluster;
a point that fails is recorded and the sweep goes on; a table of the points ends it. The points Hydra's
basic sweeper enumerates are each composed and validated before any trains (`check_points`).

Each point returns its objective (run.objective) to the sweeper, so a sweeper that optimises (Optuna's)
can; a point sampled again reports its run's recorded result instead of training it again."""

from __future__ import annotations

import copy
import json
import math
import re
import time
import typing
from dataclasses import asdict, dataclass
from pathlib import Path

SWEEP_RECORD = "sweep.json"  # beside Hydra's multirun.yaml in the sweep's directory


@dataclass
class Point:
    overrides: str  # the point's swept values, e.g. "optim.lr=0.001"
    run_dir: str | None  # None: a point refused before its run directory was made
    status: str  # completed | reused | stopped | refused | failed | not run (a stopped sweep's later points)
    final_loss: float | None = None
    final_val_loss: float | None = None
    error: str | None = None
    objective: float | None = None  # what the sweeper got


def objective(summary: dict | None, name: str) -> float | None:
    """A point's value for the sweeper: its run's final `name` (run.objective); None for a run that did not
    complete or whose value is not finite. Optuna's sweeper (1.3) records None as a failed trial and samples
    on (NaN would end its sweep: optuna 2 refuses to be told it)."""
    value = (summary or {}).get(f"final_{name}")
    completed = summary is not None and summary.get("status") == "completed" and value is not None
    return float(value) if completed and math.isfinite(value) else None


def earlier_result(run_dir: str | Path, cfg) -> dict | None:
    """The summary of the point's run when it already completed with this very config (Hydra's record of
    its newest invocation equals `cfg`): training it again would repeat the same steps on the same data
    from the same seed, so a sweeper that samples a point twice gets the recorded result again."""
    from omegaconf import OmegaConf

    records = sorted(Path(run_dir).glob("hydra/*/.hydra/config.yaml"))
    summary_path = Path(run_dir) / "summary.json"
    if not records or not summary_path.exists():
        return None
    summary = json.loads(summary_path.read_text())
    same = OmegaConf.to_container(OmegaConf.load(records[-1])) == OmegaConf.to_container(cfg)
    done = summary.get("status") == "completed" and summary.get("final_step") == cfg.trainer.max_steps
    return summary if same and done else None


def swept_keys(overrides: list[str]) -> set[str]:
    """The keys a sweep varies (`key=a,b`, `key=range(…)`, …)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {o.key_or_group for o in OverridesParser.create().parse_overrides(overrides) if o.is_sweep_override()}


def sweep_overrides(overrides: list[str]) -> list[str]:
    """A sweep's points share the base of their names: without a run.name, one timestamp for all of them
    (each point's own config would stamp its own start)."""
    if any(o.lstrip("+").startswith("run.name=") for o in overrides):
        return overrides
    return [*overrides, f"run.name=${{model.name}}-${{strategy.name}}-{time.strftime('%Y%m%d-%H%M%S')}"]


def point_values(task_overrides: list[str], swept: set[str]) -> list[str]:
    """The point's values of the swept keys, as `key=value`."""
    return [o.lstrip("+") for o in task_overrides if o.lstrip("+").partition("=")[0] in swept]


def point_name(base: str, values: list[str], swept: set[str]) -> str:
    """`base-key_value-…` (`=` and `/` become `_`, so that `run.name=` takes the name back unquoted, to
    extend the point's run); a sweep over run.name itself names its runs."""
    if "run.name" in swept:
        return base
    return "-".join([base, *(v.replace("=", "_").replace("/", "_") for v in values)])


def check_points(overrides: list[str], swept: set[str], dirs: tuple[Path, ...] = ()) -> list[str] | None:
    """Validate every point of a sweep Hydra's basic sweeper runs, as `main` will train it (its run.name
    included), before any trains: BadInput naming the first point that cannot run and why. Returns the
    points checked, in the order they run (each as its swept values, `a=1 b=2`); None for a sweeper that
    samples (hydra/sweeper=optuna), whose points are not known up front and are each checked as it comes.
    `dirs`: the preset directories (cli.config_dirs; default the shipped ones)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from distrain.config import ConfigError
    from distrain.driver.cli import BadInput
    from distrain.driver.validation import validate
    from distrain.model.hf import resolve_init_from

    if any(o.startswith("hydra/sweeper=") and o != "hydra/sweeper=basic" for o in overrides):
        return None
    own = [o for o in overrides if not re.match(r"\+*hydra[./]", o)]  # Hydra's settings: its, not the config's
    checked = []
    with PointComposer(dirs) as composer:
        try:
            (points,) = BasicSweeper.split_arguments(composer.parser.parse_overrides(own), None)
        except HydraException as e:  # interval(): only a sampler draws from it
            raise BadInput(f"{e}; interval() needs a sweeper that samples, e.g. hydra/sweeper=optuna") from None
        for i, point in enumerate(points):
            cfg = composer.compose(point)
            values = point_values(point, swept)
            cfg.run.name = point_name(cfg.run.name, values, swept)
            try:
                validate(resolve_init_from(OmegaConf.to_object(cfg), say=lambda _: None))
            except ConfigError as e:
                where = " ".join(values) or "its only point"
                raise BadInput(
                    f"sweep point #{i} of {len(points)} ({where}) cannot run: {e}; nothing was trained"
                ) from None
            checked.append(" ".join(values))
    return checked


class SearchingLoader:
    """Hydra's config loader as glob() asks it for a group's options: searching the user's preset folders
    (`searchpath`, from --config-dir) too, as hydra.main's own loader does when the sweep runs."""

    def __init__(self, loader: typing.Any, searchpath: list[str]) -> None:
        self.loader, self.searchpath = loader, searchpath

    def get_group_options(self, group_name: str, results_filter: typing.Any = None, **_: typing.Any) -> list[str]:
        return self.loader.get_group_options(group_name, results_filter, "train", self.searchpath)


class PointComposer:
    """Hydra's compose of `train` for many points, fast: the defaults list (the slow part, ~0.1 s) is
    composed once per distinct set of config-group choices, and the values are applied to a copy as
    Hydra's own loader applies them (`_apply_overrides_to_config`), giving the config `compose` gives.
    `dirs`: the preset directories (cli.config_dirs), the shipped ones by default."""

    def __init__(self, dirs: tuple[Path, ...] = ()) -> None:
        from distrain.driver.cli import CONF_DIR

        self.dirs = dirs or (CONF_DIR,)

    def __enter__(self) -> PointComposer:
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from distrain.driver.cli import CONF_DIR, register, searchpath

        register()
        self.context = initialize_config_dir(str(CONF_DIR), version_base="1.3")
        self.context.__enter__()
        self.searchpath = searchpath(self.dirs)
        loader = SearchingLoader(GlobalHydra.instance().config_loader(), self.searchpath)
        self.parser = OverridesParser.create(config_loader=loader)  # for glob()
        self.groups: dict[tuple[str, ...], typing.Any] = {}
        return self

    def __exit__(self, *exc: object) -> None:
        self.context.__exit__(*exc)

    def compose(self, overrides: list[str]) -> typing.Any:
        """The DictConfig `hydra.compose("train", overrides)` returns."""
        from hydra import compose
        from hydra._internal.config_loader_impl import ConfigLoaderImpl

        from distrain.driver.cli import is_group

        choices, values = [], []
        for o in self.parser.parse_overrides(overrides):
            group = o.package is not None or is_group(o.key_or_group, self.dirs)
            (choices if group else values).append(o)
        key = (*(o.input_line for o in choices), *self.searchpath)
        if key not in self.groups:
            self.groups[key] = compose("train", overrides=list(key))
        cfg = copy.deepcopy(self.groups[key])
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        return cfg


def not_run(planned: list[str], ran: list[Point]) -> list[Point]:
    """The points of a sweep stopped midway that it never reached: `planned` (check_points) after those that ran."""
    return [Point(overrides, None, "not run") for overrides in planned[len(ran) :]]


def table(points: list[Point]) -> str:
    """The sweep's points, one line each."""
    rows = [("#", "overrides", "status", "loss", "val loss", "run directory")]
    for i, p in enumerate(points):
        loss = f"{p.final_loss:.4f}" if p.final_loss is not None else "-"
        val = f"{p.final_val_loss:.4f}" if p.final_val_loss is not None else "-"
        rows.append((str(i), p.overrides or "-", p.status, loss, val, p.run_dir or "-"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    failed = [f"#{i}: {p.error}" for i, p in enumerate(points) if p.error]
    return "\n".join([f"distrain: sweep of {len(points)} points", *lines, *failed])


def write_record(sweep_dir: str | Path, points: list[Point]) -> None:
    path = Path(sweep_dir) / SWEEP_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(p) for p in points], indent=1) + "\n")
