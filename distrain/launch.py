"""The driver: validated config → run directory → placed Ray workers → each runs the trainer.

This is where the two layers meet: `distrain.cluster` places and watches workers without knowing
what they run, and `distrain.train` trains one rank without knowing it runs under Ray.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

from distrain import checkpoint
from distrain.cluster.runtime import attach_address, check_capacity, connect, has_gpus
from distrain.cluster.worker_group import GroupSpec, WorkerGroup
from distrain.config import ConfigError, TrainConfig, to_plain
from distrain.fsutil import exclusive_lock, write_json
from distrain.plan import describe
from distrain.progress import ProgressLine
from distrain.tracking import SUMMARY_FILE, read_metrics, wandb_mode, write_summary
from distrain.train.loop import run_rank
from distrain.validation import validate

LOCK_FILE = ".lock"  # held by the driver while the run trains: one writer per run directory


def group_spec(cfg: TrainConfig) -> GroupSpec:
    c = cfg.cluster
    use_gpu = has_gpus() if c.use_gpu is None else c.use_gpu
    return GroupSpec(
        num_workers=c.num_workers,
        cpus_per_worker=c.cpus_per_worker,
        gpus_per_worker=1 if use_gpu else 0,
        threads_per_worker=c.threads_per_worker,
        placement_strategy=c.placement_strategy,
        placement_timeout_s=c.placement_timeout_s,
        node_group=cfg.strategy.tp,  # a tensor-parallel group never spans two nodes
        # W&B settings and key live in the user's environment, which workers on a cluster do not share.
        env=tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("WANDB_"))),
    )


def train(cfg: TrainConfig) -> dict:
    """Train the run `cfg` describes, resuming from its newest committed checkpoint if it has one;
    return the summary also written to summary.json. With `cfg.plan`, write nothing and return the
    layout's description instead (`plan`)."""
    started = time.time()
    validate(cfg)
    if not os.path.isabs(cfg.run.storage) and attach_address(cfg.cluster.address):
        raise ConfigError(
            f"run.storage={cfg.run.storage!r} is relative, and on a Ray cluster the job's working directory is "
            f"temporary: give an absolute path on storage every node shares"
        )
    if cfg.plan:
        return {"status": "planned", "plan": plan(cfg)}
    cfg.run.storage = os.path.abspath(cfg.run.storage)  # workers run elsewhere
    cfg.logger.wandb.mode = wandb_mode(cfg.logger.wandb.mode)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(run_dir / LOCK_FILE):
        return _train_locked(cfg, run_dir, started)


def _train_locked(cfg: TrainConfig, run_dir: Path, started: float) -> dict:
    resume_from = checkpoint.latest(run_dir / "checkpoints")
    job = {
        "config": to_plain(cfg),
        "run_dir": str(run_dir),
        "resume_from": str(resume_from) if resume_from else None,
        "started_at": started,
    }
    if resume_from:
        check_resumable(checkpoint.read_meta(resume_from).get("config"), job["config"])

    spec = placeable_spec(cfg)
    summary = {
        "status": "failed",
        "restarts": 0,
        "resumed_from": job["resume_from"],
        "history": _previous_summaries(run_dir),
    }
    progress = ProgressLine(cfg.logger.progress_interval_s)
    try:
        with WorkerGroup(spec) as group:
            write_json(run_dir / "placement.json", group.start())
            results = group.run(run_rank, job, on_progress=lambda ranks: progress.update(ranks[0]))
        summary.update(results[0], status="completed")
    except BaseException as e:
        logged = read_metrics(str(run_dir))
        summary.update(
            final_step=logged[-1]["step"] if logged else 0,
            final_loss=logged[-1]["loss"] if logged else None,
            error=f"{type(e).__name__}: {e}",
        )
        raise
    finally:
        progress.close()
        summary["wall_s"] = time.time() - started
        write_summary(str(run_dir), summary)
    return summary


def placeable_spec(cfg: TrainConfig) -> GroupSpec:
    """Connect to the cluster and fail at once if it could never hold the workers."""
    connect(cfg.cluster.address)
    spec = group_spec(cfg)
    check_capacity(spec.num_workers, spec.cpus_per_worker, spec.gpus_per_worker)
    return spec


def plan(cfg: TrainConfig) -> str:
    """Place the workers as the run would (only placement tells which node and GPU hold each rank),
    describe the layout, and let them go: no run directory, lock, checkpoint or metrics."""
    with WorkerGroup(placeable_spec(cfg)) as group:
        return describe(cfg, group.start())


def check_resumable(saved: dict | None, current: dict) -> None:
    """A checkpoint resumes only into the same model; data and batch changes are allowed but break
    the promise of an exact resume, so they are pointed out."""
    if saved is None:
        return
    for key, old in saved["model"].items():
        new = current["model"].get(key)
        if new != old:
            raise ConfigError(
                f"run {current['run']['name']!r} was trained with model.{key}={old!r}, this config has {new!r}: "
                f"resume with the same model, or start a new run.name"
            )
    for section, key in (
        ("trainer", "seed"),
        ("trainer", "global_batch_size"),
        ("trainer", "seq_len"),
        ("data", "path"),
    ):
        if saved[section][key] != current[section][key]:
            warnings.warn(
                f"resuming with {section}.{key}={current[section][key]!r} (the checkpoint's run used "
                f"{saved[section][key]!r}): training continues, but not as the original run would have",
                stacklevel=2,
            )


def _previous_summaries(run_dir: Path) -> list[dict]:
    """Earlier invocations of the same run, so a rerun's summary.json keeps their record."""
    path = run_dir / SUMMARY_FILE
    if not path.exists():
        return []
    previous = json.loads(path.read_text())
    return [*previous.pop("history", []), previous]
