"""The driver: validated config → run directory → placed Ray workers → each runs the trainer.

This is where the two layers meet: `distrain.cluster` places and watches workers without knowing
what they run, and `distrain.train` trains one rank without knowing it runs under Ray.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from distrain import checkpoint
from distrain.cluster.runtime import check_capacity, connect, has_gpus
from distrain.cluster.worker_group import GroupSpec, WorkerGroup
from distrain.config import TrainConfig, to_plain, validate
from distrain.fsutil import write_json
from distrain.progress import ProgressLine
from distrain.tracking import SUMMARY_FILE, write_summary
from distrain.train.loop import run_rank


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
    )


def train(cfg: TrainConfig) -> dict:
    """Train the run `cfg` describes, resuming from its newest committed checkpoint if it has one;
    return the summary also written to summary.json."""
    started = time.time()
    validate(cfg)
    cfg.run.storage = os.path.abspath(cfg.run.storage)  # workers (and `ray job submit`) run elsewhere
    run_dir = Path(cfg.run_dir)
    resume_from = checkpoint.latest(run_dir / "checkpoints")

    connect(cfg.cluster.address)
    spec = group_spec(cfg)
    check_capacity(spec.num_workers, spec.cpus_per_worker, spec.gpus_per_worker)

    run_dir.mkdir(parents=True, exist_ok=True)
    job = {
        "config": to_plain(cfg),
        "run_dir": str(run_dir),
        "resume_from": str(resume_from) if resume_from else None,
        "started_at": started,
    }
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
        summary["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        progress.close()
        summary["wall_s"] = time.time() - started
        write_summary(str(run_dir), summary)
    return summary


def _previous_summaries(run_dir: Path) -> list[dict]:
    """Earlier invocations of the same run, so a rerun's summary.json keeps their record."""
    path = run_dir / SUMMARY_FILE
    if not path.exists():
        return []
    previous = json.loads(path.read_text())
    return [*previous.pop("history", []), previous]
