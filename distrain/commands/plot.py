"""A picture of one run or several, from their metrics.jsonl, with no account:

    distrain plot run.name=NAME[,NAME...] [run.storage=runs|URL] [out=FILE.png|.svg|.pdf]
    (a checkout: python jobs/plot.py run.name=NAME[,NAME...] [...])

Three panels against the step: the train loss (validation loss dashed, with dots), the learning rate and the
tokens per second; each run a colour of its own, overlaid. A restart (every attempt after a run's first, from
summary.json: a failure's recovery or a rerun that resumed) is a dotted vertical line at the step it resumed from.
Runs are read where training wrote them: a directory, or an object store's URL (run.storage=s3://bucket/prefix,
the environment's credentials and endpoint); a NAME may instead be a run's own location (a URL or an absolute
path), to overlay runs kept in different places. The image goes to the local file `out` (default: the run
directory's plot.png; for several runs, plot-A-vs-B.png in run.storage; where that is on an object store, the same
name in the current directory), its format named by its suffix. Bad input: one line and exit status 2."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from distrain.config import ConfigError
from distrain.driver.jobargs import meant
from distrain.storage.objectstore import StorageError, Store, quick_options
from distrain.storage.tracking import METRICS_FILE, SUMMARY_FILE, parse_metrics
from distrain.urls import check_location, is_url, looks_like_url, run_location

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ARGUMENTS = "run.name=NAME[,NAME...] [run.storage=runs|URL] [out=FILE.png|.svg|.pdf]"
PLOT_HINT = 'pip install -e ".[plot]"'
# (metrics.jsonl key, panel title, y label); a run's line of each is labelled "<run> <key>"
PANELS = [
    ("loss", "loss (validation dashed)", "cross-entropy"),
    ("lr", "learning rate", "lr"),
    ("tokens_per_s", "throughput", "tokens/s"),
]


@dataclass
class Run:
    """What the picture takes from a run directory: its metrics lines and the steps it restarted from."""

    name: str
    records: list[dict]
    restarts: list[int] = field(default_factory=list)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the lines that hold `key`."""
        pairs = [(r["step"], r[key]) for r in self.records if r.get(key) is not None]
        return [s for s, _ in pairs], [v for _, v in pairs]


def restarts(summary: dict) -> list[int]:
    """The step each attempt after the run's first resumed from, over its invocations (summary.json's
    history, then the latest), in order."""
    attempts = [a for s in [*summary.get("history", []), summary] for a in s.get("attempts", [])]
    return [a.get("info", {}).get("resumed_from_step", 0) for a in attempts[1:]]


def place(storage: str | Path, name: str) -> str:
    """Where the run `name` is: its own location if it is a URL (or an absolute path), else in `storage`."""
    return name if is_url(name) else run_location(str(storage), name)


def reader(where: str) -> Store:
    """A run's folder or URL, read the same way (a folder through fsspec's local filesystem); a store's errors
    come in seconds (short timeouts)."""
    url = where if is_url(where) else f"file://{os.path.abspath(where)}"
    return Store(url, quick_options(url, {}), retries=1)


def read(store: Store, name: str) -> bytes | None:
    try:
        return store.read_bytes(name)
    except FileNotFoundError:
        return None


def load_run(storage: str | Path, name: str) -> Run:
    """A run's metrics and restarts, from its directory or its URL; a one-line ConfigError for no such run, no
    metrics yet or a store that cannot be read."""
    where = place(storage, name)
    store = reader(where)
    try:
        metrics, summary = read(store, METRICS_FILE), read(store, SUMMARY_FILE)
        if metrics is None and not store.exists(""):
            parent = where.rstrip("/").rpartition("/")[0] or "."
            found = reader(parent)
            known = [c for c in found.children() if found.exists(f"{c}/{METRICS_FILE}")]
            there = f"runs in {parent}: {', '.join(known)}" if known else f"{parent} holds no runs"
            close = meant(name, known)
            fix = f"did you mean run.name={close}?" if close else "give run.name (and run.storage)"
            raise ConfigError(f"run.name={name}: no run at {where} ({there}); {fix}")
    except StorageError as e:
        raise ConfigError(f"run.name={name}: cannot read the run at {where}: {e}") from None
    records = [r for r in parse_metrics((metrics or b"").decode()) if "step" in r]
    if not records:
        raise ConfigError(
            f"run {name} has no metrics yet ({where}/{METRICS_FILE} is missing or empty): a run logs a line "
            "every trainer.log_interval steps once training has begun"
        )
    return Run(name, records, restarts(json.loads(summary) if summary else {}))


def figure(runs: list[Run]) -> Figure:
    """The runs' panels, one above the other, sharing the step axis (Agg: no screen needed)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 8), layout="constrained")
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (key, title, unit) in zip(axes, PANELS, strict=True):
        ax.set_title(title, loc="left")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        for run, colour in zip(runs, colours, strict=True):
            ax.plot(*run.series(key), color=colour, linewidth=1.5, label=f"{run.name} {key}")
            if key == "loss" and (val := run.series("val_loss"))[0]:
                ax.plot(*val, color=colour, linestyle="--", marker="o", markersize=3, label=f"{run.name} val_loss")
            for step in run.restarts:
                ax.axvline(step, color=colour, linestyle=":", linewidth=1.2, label=f"{run.name} restart")
    axes[-1].set_xlabel("step")
    axes[0].legend(handles=legend(axes[0], runs, colours), fontsize="small", loc="upper right")
    return fig


def legend(ax, runs: list[Run], colours: list[str]) -> list:  # noqa: ANN001  (a matplotlib Axes)
    """One entry per run, then what the line styles mean."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, label=r.name) for r, c in zip(runs, colours, strict=True)]
    handles += [Line2D([], [], color="grey", linestyle="--", marker="o", markersize=3, label="validation loss")]
    if any(r.restarts for r in runs):
        handles.append(Line2D([], [], color="grey", linestyle=":", label="restart (resumed from this step)"))
    return handles


def default_out(storage: str | Path, names: list[str]) -> Path:
    """The run directory's plot.png, for several runs plot-A-vs-B.png in run.storage; where that is on an object
    store, the same name in the current directory: a picture is looked at here, and nothing is written to a store."""
    places = [place(storage, name) for name in names]
    if len(places) == 1 and not is_url(places[0]):
        return Path(places[0]) / "plot.png"
    stem = "-vs-".join(p.rstrip("/").rpartition("/")[2] for p in places)
    return (Path.cwd() if len(places) == 1 or is_url(str(storage)) else Path(storage)) / f"plot-{stem}.png"


def plot(storage: str | Path, names: list[str], out: Path | None = None) -> Path:
    """Draw the named runs into `out` (default: default_out); the path written."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(f"plot draws with matplotlib, which is not installed: {PLOT_HINT}") from None
    matplotlib.use("Agg")
    runs = [load_run(storage, name) for name in names]
    out = out or default_out(storage, names)
    fig = figure(runs)
    formats = fig.canvas.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in formats:
        raise ConfigError(f"out={out}: give a file name ending in one of .{', .'.join(sorted(formats))}")
    fig.suptitle(", ".join(names))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def main(argv: list[str]) -> None:
    from distrain.commands import helped, how
    from distrain.driver.jobargs import REQUIRED, Location, run_job

    if helped(argv, __doc__):
        return
    usage = f"{how('plot')} {ARGUMENTS}"

    def work(args: dict) -> str:
        names = [n for n in args["run.name"].split(",") if n]
        if not names:
            raise ConfigError(f"run.name= names no run; usage: {usage}")
        for name in names:
            try:
                check_location(name, "run.name")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if looks_like_url(args["out"]):
            raise ConfigError(
                f"out={args['out']!r}: the picture is written to a local file: give a path (and copy the file to a "
                "store with its own tools)"
            )
        out = plot(args["run.storage"], names, Path(args["out"]) if args["out"] else None)
        return f"distrain: plotted {', '.join(names)} to {out}"

    spec = {"run.name": (str, REQUIRED), "run.storage": (Location, "runs"), "out": (str, None)}
    run_job(argv, spec, usage, work)
