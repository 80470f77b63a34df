"""The driver: validated config → run directory → an engine under the supervisor → summary.

This is where the two layers meet: `distrain.cluster` places, watches and recovers workers without
knowing what they run, and `distrain.train` trains one rank without knowing it runs under Ray. An
engine says what an attempt runs: collective training (`AllReduceEngine`, below) or the parameter
server (`distrain.ps.engine`).
"""

from __future__ import annotations

import json
import os
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from distrain.cluster.attempt import Attempt
from distrain.cluster.placement import GroupSpec
from distrain.cluster.policy import failure_policy, policy_class
from distrain.cluster.runtime import check_capacity, connect, gpu_count, wait_for_gpus
from distrain.cluster.states import Finished, Work
from distrain.cluster.supervisor import Supervisor
from distrain.cluster.timeouts import Timeouts
from distrain.cluster.worker_group import WorkerGroup
from distrain.config import ClusterConfig, ConfigError, TrainConfig, attach_address, to_plain
from distrain.data.checks import check_same_shards
from distrain.driver.fits import check_fits
from distrain.driver.objectrun import check_run_url, on_store
from distrain.driver.peers import HELD, plan_recovery
from distrain.driver.plan import describe
from distrain.driver.stop import Stopped, stop_signals
from distrain.driver.validation import validate
from distrain.model.hf import resolve_init_from
from distrain.progress import ProgressLine
from distrain.storage import checkpoint, remote
from distrain.storage.fsutil import exclusive_lock, make_writable_dir, remove_empty
from distrain.storage.objectstore import store_for
from distrain.storage.tracking import SUMMARY_FILE, read_metrics, wandb_mode, write_summary
from distrain.storage.urls import is_url
from distrain.strategy.layout import Layout
from distrain.train.job import RankJob

LOCK_FILE = ".lock"  # held by the driver while the run trains: one writer per run directory
DEFAULT_STOP_GRACE_S = 30.0
RAY_JOB_STOP_WAIT_DEFAULT_S = 3.0  # Ray's own default (dashboard/modules/job/job_supervisor.py)
# The workers' modules, named rather than imported: they import torch, which the driver never needs
# (seconds of its start, on the path to the first step).
TRAINER, PROCESS_GROUP = "distrain.train.loop", "distrain.parallel.process_group"


class AllReduceEngine:
    """Collective training: every rank runs `train.loop.run_rank` in one process group; a failure
    restarts the group from the state its live replicas keep in memory (driver/peers.py), or else from the
    newest committed checkpoint, on the layout of its size."""

    replaces_workers = False

    def __init__(self, job: RankJob, layouts: dict[int, Layout]):
        self.job, self.layouts, self.run_dir = job, layouts, Path(job.run_dir)
        self.recoveries = 0  # from replicas, so far
        self.replicas_offered = False  # from_replicas found every shard held: the next `begin` plans from them

    def from_replicas(self, group: WorkerGroup) -> tuple[bool, str]:
        if not self.job.config.cluster.peer_recovery:
            return False, ""
        layout = self.layouts[len(group.table)]
        held = group.ask(HELD, sorted(group.returned), timeout_s=2.0)
        plan, why = plan_recovery(layout, held, self.job.run_id, self.recoveries + 1)
        self.replicas_offered = plan is not None
        return plan is not None, why

    def warm_up(self) -> tuple[str, tuple]:
        return f"{TRAINER}:warm_up", (self.job.config,)

    def begin(self, group: WorkerGroup, attempt: Attempt) -> Work:
        """The attempt's work; and what the group runs in the ranks after a failure: an abort of the
        collectives that ranks whose peer died wait in (on NCCL they would wait out the collective timeout,
        then be killed), and a check on the device before a process is kept."""
        group.recover_with(f"{PROCESS_GROUP}:check_device", f"{PROCESS_GROUP}:abort")
        layout, plan, note = self.layouts[len(group.table)], None, ""
        if self.replicas_offered:  # asked again: the group was refilled and ranked anew
            self.replicas_offered = False
            plan, why = plan_recovery(layout, group.ask(HELD), self.job.run_id, self.recoveries + 1)
            note = "" if plan else f"restarting from the last checkpoint after all: {why}"
        job = replace(self.job, layout=layout, use_gpu=group.spec.gpus_per_worker > 0)  # a GPU given is used
        if plan is not None:
            self.recoveries += 1
            attempt.info.update(resumed_from_step=plan.step, resumed_from="replicas")
            job = replace(job, peers=plan)
        else:
            latest, meta = newest_checkpoint(self.job.config, self.run_dir)
            attempt.info["resumed_from_step"] = meta.get("step", 0)
            job = replace(job, resume_from=latest and str(latest))
            if attempt.number > 1:  # a restart: from where, said (the first attempt's resume is the summary's)
                where = f"the checkpoint of step {meta['step']}" if latest else "step 0 (no checkpoint committed yet)"
                note = "; ".join(filter(None, [note, f"attempt {attempt.number} starts from {where}"]))
        return Work(f"{TRAINER}:run_rank", (job,), note=note)

    def tick(self, suspect: bool) -> None:
        pass

    def replaced(self, rank: int) -> None:
        raise AssertionError("a process group restarts together")

    def request_stop(self, deadline: float) -> None:
        pass

    def finish(self, results: list[Any]) -> dict:
        return results[0]  # rank 0's record of the run

    def end(self, keep: bool = False) -> None:
        pass


def print_event(text: str) -> None:
    """A driver's event line, where there is no progress line to print it (a plan)."""
    print(f"distrain: {text}", flush=True)


def group_spec(cfg: TrainConfig, layout: Layout, say: Callable[[str], None] = print_event) -> GroupSpec:
    """The worker group the config asks for. With cluster.use_gpu=null, a GPU per worker if the cluster
    has GPUs now: which one was chosen, and why, is said (an autoscaling cluster may have none up yet)."""
    c = cfg.cluster
    use_gpu = c.use_gpu
    if use_gpu is None:
        gpus = gpu_count()
        use_gpu = gpus > 0
        say(
            f"cluster.use_gpu=null: the cluster has {gpus:g} GPUs, so each worker gets one"
            if use_gpu
            else "cluster.use_gpu=null: the cluster has no GPU now, so the workers train on CPUs; set "
            "cluster.use_gpu=true to wait for GPU nodes (an autoscaler starts them for work that asks)"
        )
    return GroupSpec(
        num_workers=c.num_workers,
        cpus_per_worker=c.cpus_per_worker,
        gpus_per_worker=1 if use_gpu else 0,
        threads_per_worker=c.threads_per_worker,
        placement_strategy=c.placement_strategy,
        placement_timeout_s=c.placement_timeout_s,
        start_timeout_s=c.setup_timeout_s,
        node_group=layout.tp,  # a tensor-parallel group never spans two nodes
        spares=c.spares,
        env=worker_env(c),
    )


# W&B's settings and key, the collectives', torch's, and the object stores' (credentials, endpoint: never in the
# config): passed with each call to the workers, never recorded.
FORWARDED = ("WANDB_", "NCCL_", "GLOO_", "TORCH_", "CUDA_", "AWS_", "GOOGLE_", "AZURE_")


def worker_env(c: ClusterConfig) -> tuple[tuple[str, str], ...]:
    """What every worker gets of the user's environment, which workers on other hosts do not share: the
    driver's variables of the FORWARDED families (not CUDA_VISIBLE_DEVICES: each node has its own GPUs),
    then cluster.env_vars. Either may name gloo's and NCCL's interface, which then overrides the one each
    worker finds for its node address."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED) and k != "CUDA_VISIBLE_DEVICES"}
    return tuple(sorted({**env, **c.env_vars}.items()))


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
    writes nothing. A signal while attaching or checking raises `Stopped`; one while the workers are placed
    and started ends the run at once, `stopped`; once their calls went out, it stops cleanly."""
    started = time.time()
    cfg, layout = resolved(cfg)
    if cfg.plan:
        return {"status": "planned", "plan": plan(cfg, layout)}
    with stop_signals() as stop:
        progress = ProgressLine(cfg.logger.progress_interval_s)
        run_dir, made = make_run_dir(cfg)  # first: storage that cannot hold it is refused before Ray starts
        try:
            spec = stop.guard(lambda: placeable_spec(cfg, layout, progress.message))
        except BaseException:
            remove_empty(made)  # a refusal, or a stop, leaves nothing behind
            raise
        connected = time.time()
        # A run on an object store: its lock there, its record pulled and synced; then the directory's lock.
        with on_store(cfg, run_dir, progress.message, made), exclusive_lock(run_dir / LOCK_FILE):
            supervisor, summary = stop.guard(lambda: _prepare(cfg, layout, spec, run_dir, progress, started))
            summary["startup"] = {**(startup or {}), "started_at": started, "connected_at": connected}
            if on_run_dir is not None:
                on_run_dir(run_dir)
            stop.install()
            stop.forward_to(supervisor.request_stop)
            try:
                finished = Finished(None, stopped=True) if stop.received else stop.guard(supervisor.run)
                stopped = finished.stopped
                summary.update(finished.results or _from_metrics(run_dir), status="stopped" if stopped else "completed")
            except Stopped:  # nothing to save yet: stopped at once
                summary.update(_from_metrics(run_dir), status="stopped")
            except BaseException as e:
                summary.update(_from_metrics(run_dir), error=f"{type(e).__name__}: {e}")
                raise
            finally:
                stop.forward_to(lambda: True)  # the run has ended: a first signal now lets its record be written
                progress.close()
                summary["attempts"] = [a.record() for a in supervisor.attempts]
                summary["replacements"] = supervisor.replacements
                summary["restarts"] = supervisor.restarts
                summary["steps_executed"] = sum(a.steps_run for a in supervisor.attempts)
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
    cfg: TrainConfig, layout: Layout, spec: GroupSpec, run_dir: Path, progress: ProgressLine, started: float
) -> tuple:
    """The supervisor of the run (its engine: collective training or the parameter server) and the summary
    it starts from (the run's history, its W&B id); ConfigError, before anything is written, for a
    checkpoint this config cannot resume. `started`: the driver's start."""
    resume_from, meta = newest_checkpoint(cfg, run_dir)
    if resume_from:
        check_resumable(meta.get("config"), to_plain(cfg))
        check_steps_left(meta, cfg, progress.message)
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

        engine = ParameterServerEngine(cfg, layout, spec, run_dir, wandb_run_id, started, progress.update)
        on_rank_progress, sizes = lambda p: None, [layout.world_size]
    else:
        layouts = {layout.world_size: layout, **layout.smaller(cfg)}
        job = RankJob(cfg, layout, str(run_dir), started, wandb_run_id, run_id=uuid.uuid4().hex)
        engine, on_rank_progress, sizes = AllReduceEngine(job, layouts), progress.update, list(layouts)
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


def stop_grace_s() -> float:
    """How long after SIGTERM the driver still lives: under `ray job submit` (which sets
    RAY_JOB_CONFIG_JSON_ENV_VAR for the driver), RAY_JOB_STOP_WAIT_TIME_S, 3 s unless the job's
    env_vars say otherwise; elsewhere (a terminal, a scheduler) 30 s unless that variable is set."""
    under_ray_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
    default = RAY_JOB_STOP_WAIT_DEFAULT_S if under_ray_job else DEFAULT_STOP_GRACE_S
    return float(os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", default))


def _from_metrics(run_dir: Path) -> dict:
    logged = read_metrics(str(run_dir))
    return {"final_step": logged[-1]["step"] if logged else 0, "final_loss": logged[-1]["loss"] if logged else None}


def placeable_spec(cfg: TrainConfig, layout: Layout, say: Callable[[str], None] = print_event) -> GroupSpec:
    """Connect to the cluster and fail at once if it could never hold the workers, spares and servers, or
    (a run, not a plan) a rank's estimated memory; with cluster.use_gpu=true on a cluster attached to, first
    wait (placement_timeout_s) for GPUs it lacks. `say` prints events."""
    c = cfg.cluster
    address = attach_address(c.address)
    if address:
        say(
            f"attaching to the Ray cluster at {address} "
            f"(giving up after cluster.connect_timeout_s={c.connect_timeout_s:g} s)"
        )
    connect(c.address, c.local_cpus, c.local_gpus, c.connect_timeout_s)
    choice: list[str] = []  # which devices cluster.use_gpu=null chose: said once the run is not refused
    spec = group_spec(cfg, layout, choice.append)
    if c.use_gpu and address:  # an embedded cluster has no autoscaler: the GPUs it lacks now never come
        wait_for_gpus(spec, say)
    servers = cfg.ps.num_servers if cfg.ps.mode is not None else 0
    check_capacity(spec.num_workers, spec.cpus_per_worker, spec.gpus_per_worker, spec.spares, servers)
    if not cfg.plan:  # a plan shows the estimate instead
        check_fits(cfg, layout, spec.gpus_per_worker > 0, say)
    for line in choice:
        say(line)
    return spec


def plan(cfg: TrainConfig, layout: Layout) -> str:
    """Place the workers as the run would (only placement tells which node and GPU holds each rank),
    describe the layout, and let them go: no run directory, lock, checkpoint or metrics."""
    with WorkerGroup(placeable_spec(cfg, layout)) as group:
        return describe(cfg, layout, group.start())


def check_resumable(saved: dict | None, current: dict) -> None:
    """A checkpoint resumes only into the same model; data and batch changes are allowed but break
    the promise of an exact resume, so they are pointed out; other token shards are refused."""
    if saved is None:
        return
    check_same_shards(saved, current)
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


def check_steps_left(meta: dict, cfg: TrainConfig, say: Callable[[str], None] = print_event) -> None:
    """A rerun whose checkpoint is already at trainer.max_steps would train nothing: refused. One asking
    for more (or fewer) steps than the checkpoint's run extends (or shortens) it, which is said: the LR
    schedule follows trainer.max_steps unless optim.decay_steps fixes its length, so its LR changes."""
    step, steps, name = meta["step"], cfg.trainer.max_steps, cfg.run.name
    if step >= steps:
        raise ConfigError(
            f"run {name!r} has trained {step} steps, so trainer.max_steps={steps} leaves nothing to train: give "
            f"trainer.max_steps above {step} to extend it, or a new run.name"
        )
    before = (meta.get("config") or {}).get("trainer", {}).get("max_steps")
    if before is not None and before != steps:
        how = "stretches to" if before < steps else "shrinks to"
        schedule = (
            f"optim.decay_steps={cfg.optim.decay_steps} keeps the LR schedule"
            if cfg.optim.decay_steps
            else f"the LR schedule {how} the new length (set optim.decay_steps={before} to keep it)"
        )
        change = "extending" if before < steps else "shortening"
        say(f"{change} run {name!r} from trainer.max_steps={before} to {steps}, from step {step}: {schedule}")


def make_run_dir(cfg: TrainConfig) -> tuple[Path, list[Path]]:
    """The run directory (a run on an object store: its local mirror), made and written to once, and the
    directories made for it (deepest first); or a one-line ConfigError about run.storage (read-only, a file,
    /sys), or storage.cache_dir, with nothing left behind."""
    run_dir = Path(cfg.run_dir)
    try:
        return run_dir, make_writable_dir(run_dir)
    except OSError as e:
        key = f"storage.cache_dir={cfg.storage.cache_dir!r}" if cfg.run_url else f"run.storage={cfg.run.storage!r}"
        raise ConfigError(
            f"{key} cannot hold the run directory {str(run_dir)!r} ({e.strerror or e}): give a directory you can write"
        ) from None


def newest_checkpoint(cfg: TrainConfig, run_dir: Path) -> tuple[Path | None, dict]:
    """The checkpoint a (re)start resumes from, and its metadata: the newest that verifies in the run
    directory; with an object store, the newest committed there (its marker and meta.json read from the
    store, nothing downloaded: each rank fetches it into its node's mirror, where this path names it)."""
    if cfg.run_url:
        found = remote.latest_meta(store_for(cfg.run_url, cfg.storage))
        return (run_dir / remote.PREFIX / found[0], found[1]) if found else (None, {})
    path = checkpoint.latest(run_dir / "checkpoints")
    return path, (checkpoint.read_meta(path) if path else {})


def _previous_summaries(run_dir: Path) -> list[dict]:
    """Earlier invocations of the same run, so a rerun's summary.json keeps their record."""
    path = run_dir / SUMMARY_FILE
    if not path.exists():
        return []
    previous = json.loads(path.read_text())
    return [*previous.pop("history", []), previous]
