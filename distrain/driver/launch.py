"""The driver: validated config → run directory → an engine under the supervisor → summary.

This is where the two layers meet: `distrain.cluster` places, watches and recovers workers without
knowing what they run, and `distrain.train` trains one rank without knowing it runs under Ray. An
engine says what an attempt runs and where it starts: collective training (`driver/collective.py`) or the
parameter server (`distrain/ps/engine.py`); this module is the run's lifecycle around it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from distrain.cluster.history import nothing_happened
from distrain.cluster.placement import GroupSpec
from distrain.cluster.policy import failure_policy, policy_class
from distrain.cluster.resources import embedded_resources
from distrain.cluster.supervisor import Supervisor
from distrain.cluster.timeouts import Timeouts
from distrain.cluster.worker_group import WorkerGroup
from distrain.config import ClusterConfig, ConfigError, TrainConfig, attach_address
from distrain.driver import finetune
from distrain.driver.collective import AllReduceEngine
from distrain.driver.fits import verdict
from distrain.driver.objectrun import check_run_url
from distrain.driver.plan import describe
from distrain.driver.rerun import Found, claimed
from distrain.driver.stop import Stopped, StoppedBeforeStart, stop_grace_s, stop_signals
from distrain.driver.validation import validate
from distrain.driver.workers import placeable_spec
from distrain.model.hf import resolve_init_from
from distrain.progress import ProgressLine
from distrain.storage.tracking import SUMMARY_FILE, read_metrics, wandb_mode, write_summary
from distrain.strategy.layout import Layout
from distrain.strategy.resolve import smaller
from distrain.train.job import RankJob
from distrain.urls import is_url


def train(
    cfg: TrainConfig, startup: dict[str, float] | None = None, on_run_dir: Callable[[Path], None] | None = None
) -> dict:
    """Train the run `cfg` describes, resuming from its newest committed checkpoint if it has one,
    under the supervisor (restarts, hangs, node loss, SIGTERM); return the summary also written to
    summary.json. With `cfg.plan`, write nothing and return the layout's description instead.
    `startup`: wall-clock marks of the caller's own start (jobs/train.py: its imports, Hydra's compose),
    which summary.json's `startup` holds with this driver's (started_at, connected_at: Ray is up).
    `on_run_dir`: called with the run directory once every check has passed (the command line keeps its
    record and console log there). A refusal (config, cluster, a run in use, a resume that cannot be)
    writes nothing; what the config and the run directory decide (a run in use, a finished one, a resume
    into another model) is refused before Ray starts. A signal before the ranks' first step raises `Stopped`
    (StoppedBeforeStart: a run directory it made is removed again); after it, the run stops cleanly, `stopped` (at
    once at a second signal)."""
    started = time.time()
    cfg, layout = resolved(cfg)
    if cfg.plan:
        return {"status": "planned", "plan": plan(cfg, layout)}
    with stop_signals() as stop, contextlib.ExitStack() as held:
        progress = ProgressLine(cfg.logger.progress_interval_s)
        # The run directory held (its lock; on an object store the lock there and the record) and its checkpoint
        # checked, then the cluster: storage that cannot hold the run, or a rerun refused, never waits for Ray.
        try:
            run_dir, found = stop.guard(lambda: held.enter_context(claimed(cfg, progress.message)))
            spec = stop.guard(lambda: placeable_spec(cfg, layout, progress.message))
            connected = time.time()
            supervisor, summary = stop.guard(lambda: _prepare(cfg, layout, spec, run_dir, found, progress, started))
        except Stopped as e:
            raise StoppedBeforeStart(e.signum) from None
        summary["startup"] = {**(startup or {}), "started_at": started, "connected_at": connected}
        if on_run_dir is not None:
            on_run_dir(run_dir)
        stop.install()
        stop.forward_to(supervisor.request_stop, progress.message)
        try:
            finished = stop.guard(supervisor.run)
            if finished.stopped and nothing_happened(supervisor.history.attempts):
                raise StoppedBeforeStart(stop.received[0])
            stopped = finished.stopped
            summary.update(finished.results or _from_metrics(run_dir), status="stopped" if stopped else "completed")
        except Stopped as e:  # at once: nothing to save yet, a second signal, a restart's back-off
            if nothing_happened(supervisor.history.attempts):
                summary = None  # nothing trained or failed: nothing recorded (rerun.claimed empties a new directory)
                raise StoppedBeforeStart(e.signum) from None
            summary.update(_from_metrics(run_dir), status="stopped")
        except BaseException as e:
            summary.update(_from_metrics(run_dir), error=f"{type(e).__name__}: {e}")
            raise
        finally:
            stop.forward_to(lambda: True)  # the run has ended: a first signal now lets its record be written
            progress.close()
            if summary is not None:
                summary.update(supervisor.history.summary())
                summary["wall_s"] = time.time() - started
                if summary["status"] == "stopped" and stop.received:
                    summary["stop_signal"] = stop.received[0]
                write_summary(str(run_dir), summary)
    return summary


def resolved(given: TrainConfig) -> tuple[TrainConfig, Layout]:
    """The config the run trains, validated, and its layout: model.init_from's family and shape (from its
    config.json), and what the workers must see resolved, since they run elsewhere and their environment
    is not the user's (absolute paths, the W&B mode)."""
    cfg = resolve_init_from(given)
    layout = validate(cfg)
    policy_class(cfg.cluster.policy)  # a user's policy imported, or a one-line error, before anything starts
    if cfg.run_url:  # an object store: its URL, never a local path; the workers keep their own mirror of it
        check_run_url(cfg)
    elif not os.path.isabs(cfg.run.storage) and attach_address(cfg.cluster.address):
        raise ConfigError(
            f"run.storage={cfg.run.storage!r} is relative, and on a Ray cluster the job's working directory is "
            f"temporary: give an absolute path on storage every node shares"
        )
    workers_see = replace(
        cfg,
        run=replace(cfg.run, storage=absolute(cfg.run.storage)),
        data=replace(cfg.data, shards=cfg.data.shards and absolute(cfg.data.shards)),
        storage=replace(cfg.storage, cache_dir=os.path.abspath(os.path.expanduser(cfg.storage.cache_dir))),
        logger=replace(cfg.logger, wandb=replace(cfg.logger.wandb, mode=wandb_mode(cfg.logger.wandb.mode))),
    )
    return workers_see, layout


def absolute(path: str) -> str:
    """A local path made absolute (the workers' working directory is not the user's); a URL as it is."""
    return path if is_url(path) else os.path.abspath(path)


def _prepare(
    cfg: TrainConfig,
    layout: Layout,
    spec: GroupSpec,
    run_dir: Path,
    found: Found,
    progress: ProgressLine,
    started: float,
) -> tuple:
    """The supervisor of the run (its engine: collective training or the parameter server) and the summary
    it starts from (the run's history, its W&B id, the checkpoint `found` to resume from, already checked).
    `started`: the driver's start."""
    resume_from, meta = found
    history = _previous_summaries(run_dir)
    wandb_run_id = meta.get("wandb_run_id") or next(
        (h["wandb_run_id"] for h in reversed(history) if h.get("wandb_run_id")), None
    )
    if cfg.logger.wandb.mode != "disabled":
        wandb_run_id = wandb_run_id or uuid.uuid4().hex[:8]  # one W&B run across every attempt
    summary = {
        "status": "failed",
        "restarts": 0,
        "resumed_from": str(resume_from) if resume_from else None,
        "wandb_run_id": wandb_run_id,
        "history": history,
    }
    if cfg.ps.mode is not None:  # a parameter server: workers replaced one by one, no process group
        from distrain.ps.engine import ParameterServerEngine

        engine = ParameterServerEngine(
            cfg, layout, spec, run_dir, wandb_run_id, started, progress.update, progress.message
        )
        on_rank_progress, sizes = lambda p: None, [layout.world_size]
    else:
        layouts = {layout.world_size: layout, **smaller(layout, cfg)}
        base = finetune.base_fingerprint(cfg)
        job = RankJob(cfg, layout, str(run_dir), started, wandb_run_id, run_id=uuid.uuid4().hex, base=base)
        engine = AllReduceEngine(job, layouts, progress.message)
        on_rank_progress, sizes = progress.update, list(layouts)
    c = cfg.cluster
    supervisor = Supervisor(
        spec,
        failure_policy(c),
        timeouts(c),
        engine,
        sizes,
        run_dir,
        on_progress=on_rank_progress,
        on_event=progress.message,
        reuse_workers=c.reuse_workers,
    )
    return supervisor, summary


def timeouts(c: ClusterConfig) -> Timeouts:
    return Timeouts(
        hang_timeout_s=c.hang_timeout_s,
        setup_timeout_s=c.setup_timeout_s,
        restart_backoff_s=c.restart_backoff_s,
        stop_grace_s=c.stop_grace_s or stop_grace_s(),
        node_check_s=c.node_check_s,
    )


def _from_metrics(run_dir: Path) -> dict:
    logged = read_metrics(str(run_dir))
    return {"final_step": logged[-1]["step"] if logged else 0, "final_loss": logged[-1]["loss"] if logged else None}


def plan(cfg: TrainConfig, layout: Layout) -> str:
    """The layout described, and what the memory check would do; nothing written (no run directory, lock,
    checkpoint or metrics). With a cluster to attach to (or one up in this process), the workers are placed as
    the run would place them (only placement tells which node and GPU holds each rank) and let go; without one,
    from the config and this machine alone: no Ray cluster starts, and the plan says the placement is not shown."""
    c = cfg.cluster
    spec = placeable_spec(cfg, layout)
    gpu, here = spec.gpus_per_worker > 0, embedded_resources(c.address, c.local_cpus, c.local_gpus)
    checked = verdict(cfg, layout, gpu, here)
    if here is not None:
        where = f"this machine's embedded Ray cluster ({here['CPU']:g} CPUs, {here['GPU']:g} GPUs) would run every rank"
        return describe(cfg, layout, None, gpu, unplaced=where, checked=checked)
    with WorkerGroup(spec) as group:
        return describe(cfg, layout, group.start(), checked=checked)


def _previous_summaries(run_dir: Path) -> list[dict]:
    """Earlier invocations of the same run, so a rerun's summary.json keeps their record."""
    path = run_dir / SUMMARY_FILE
    if not path.exists():
        return []
    previous = json.loads(path.read_text())
    return [*previous.pop("history", []), previous]
