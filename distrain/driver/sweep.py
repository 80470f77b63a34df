"""A Hydra sweep (`jobs/train.py -m optim.lr=1e-3,3e-3`): each point is a run of its own, with its own
run.name (so its own directory and W&B run), run one after another in one driver on one Ray cluster;
a point that fails is recorded and the sweep goes on; a table of the points ends it.

Each point returns its objective (run.objective) to the sweeper, so a sweeper that optimises (Optuna's)
can; a point sampled again reports its run's recorded result instead of training it again."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SWEEP_RECORD = "sweep.json"  # beside Hydra's multirun.yaml in the sweep's directory


@dataclass
class Point:
    overrides: str  # the point's swept values, e.g. "optim.lr=0.001"
    run_dir: str
    status: str  # completed | reused | stopped | refused | failed
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


def table(points: list[Point]) -> str:
    """The sweep's points, one line each."""
    rows = [("#", "overrides", "status", "loss", "val loss", "run directory")]
    for i, p in enumerate(points):
        loss = f"{p.final_loss:.4f}" if p.final_loss is not None else "-"
        val = f"{p.final_val_loss:.4f}" if p.final_val_loss is not None else "-"
        rows.append((str(i), p.overrides or "-", p.status, loss, val, p.run_dir))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    failed = [f"#{i}: {p.error}" for i, p in enumerate(points) if p.error]
    return "\n".join([f"distrain: sweep of {len(points)} points", *lines, *failed])


def write_record(sweep_dir: str | Path, points: list[Point]) -> None:
    path = Path(sweep_dir) / SWEEP_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(p) for p in points], indent=1) + "\n")
