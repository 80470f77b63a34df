"""The parameter server as an engine of the supervisor (distrain/cluster/supervisor.py).

An attempt is a group of server shards restored from the newest committed checkpoint, and the
workers. A worker that dies, raises or hangs is replaced while the others go on (the supervisor's
policy says so: `replaces_workers`); in sync mode the open round waits for the replacement, which
recomputes the missing gradient. A server that dies or stops answering loses the attempt: a new one
restores the servers from the checkpoint. Rank 0's role in collective training (metrics.jsonl, W&B,
checkpoints, the progress line) is the driver's here: no worker is special.

A checkpoint is saved by the shards into a staging directory and committed only once every metrics
line up to its step is written, with the records of later steps that its weights already hold: a
restore from it then logs every step once, with the value the training had.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distrain.channel import Progress
from distrain.cluster.attempt import Attempt
from distrain.cluster.placement import GroupSpec
from distrain.cluster.states import Work
from distrain.cluster.worker_group import WorkerGroup
from distrain.config import TrainConfig, recorded, to_plain
from distrain.driver.rerun import newest_checkpoint
from distrain.ps import saved
from distrain.ps.job import ServerJob, WorkerJob
from distrain.ps.metrics import StepLog
from distrain.ps.server_group import ServerGroup
from distrain.storage import checkpoint, remote
from distrain.storage.objectstore import store_for
from distrain.storage.record_sync import record_sync
from distrain.storage.tracking import TRACKER_FILES, Tracker, run_results
from distrain.strategy.layout import Layout

SUSPECT_CHECK_S = 3.0  # after a worker fails: how long the servers get to show they are alive


class ParameterServerEngine:
    replaces_workers = True

    def __init__(
        self,
        cfg: TrainConfig,
        layout: Layout,
        spec: GroupSpec,
        run_dir: Path,
        wandb_run_id: str | None,
        started: float,
        on_progress: Callable[[Progress], None] = lambda progress: None,
        say: Callable[[str], None] = print,
    ):
        """`say`: the driver's lines (a checkpoint not committed on the store, a restart waiting for it)."""
        self.cfg, self.spec, self.run_dir, self.root = cfg, spec, run_dir, run_dir / "checkpoints"
        self.say = say
        # On an object store: the committer of the servers' checkpoints there (this node's mirror holds its record)
        self.remote = remote.Remote(store_for(cfg.run_url, cfg.storage), say=say) if cfg.run_url else None
        self.layout = layout
        self.recorded = recorded(to_plain(cfg))  # what its checkpoints and W&B record of the config
        self.wandb_run_id, self.started, self.on_progress = wandb_run_id, started, on_progress
        self.log = StepLog(cfg)  # across attempts: a restore keeps what its checkpoint holds
        self.servers: ServerGroup | None = None
        self.tracker: Tracker | None = None
        self.group: WorkerGroup | None = None
        self.worker_job: WorkerJob | None = None
        self.last_line: tuple[int, dict] = (0, {})  # the newest step logged, and its line
        self.committed = 0  # the step of the newest committed checkpoint
        self.staged: tuple[int, Path, dict[int, int], dict] | None = None  # (step, dir, applied, files): saved
        self.stopping = False
        self.begun_at = 0.0

    def warm_up(self) -> tuple[Callable[..., Any], tuple]:
        from distrain.ps.worker import warm_up

        return warm_up, (self.cfg,)

    def begin(self, group: WorkerGroup, attempt: Attempt) -> Work:
        from distrain.ps.worker import run_worker

        latest, meta = newest_checkpoint(self.cfg, self.run_dir, self.say)  # on a store: committed there
        step = meta.get("step", 0)
        saved = meta.get("ps", {"applied": {}, "records": []})
        self.log.restart(step, {int(w): s for w, s in saved["applied"].items()}, saved["records"])
        attempt.info["resumed_from_step"] = step
        self.last_line, self.committed, self.stopping, self.begun_at = (step, {}), step, False, time.time()
        p = self.cfg.ps
        job = ServerJob(self.cfg, str(latest) if latest else None)
        spec = self.spec
        self.servers = ServerGroup(
            job, p.num_servers, spec.num_workers, spec.cpus_per_worker, spec.start_timeout_s, dict(spec.env)
        )
        where = self.servers.start()
        # The version the servers hold, as they say it: after a restore, the checkpoint's (a sync step each).
        attempt.info["servers_version"] = self.servers.drain(wait_s=self.spec.start_timeout_s)["version"]
        record = record_sync(self.cfg, self.run_dir, TRACKER_FILES)  # a run on an object store
        self.tracker = Tracker(str(self.run_dir), self.recorded, step, self.wandb_run_id, record)
        self.group = group
        use_gpu = group.spec.gpus_per_worker > 0  # Ray gave each worker a GPU: it must train on it
        self.worker_job = WorkerJob(self.cfg, self.layout, tuple(self.servers.actors), use_gpu)
        return Work(run_worker, (self.worker_job,), [{"server": k, **info} for k, info in enumerate(where)])

    def tick(self, suspect: bool) -> None:
        if suspect:  # a worker's failure may be a server's
            self.servers.check(SUSPECT_CHECK_S)
        self._drain()
        self._write(self.log.lines())
        self._commit_if_written()

    def from_replicas(self, group: WorkerGroup) -> tuple[bool, str]:
        return False, ""  # a worker holds no state of its own: the servers do

    def replaced(self, rank: int) -> None:
        self.servers.forget(rank)

    def request_stop(self, deadline: float) -> None:
        self.stopping = True
        self.servers.call("stop")

    def finish(self, results: list[Any]) -> dict:
        """Every worker returned: the last records, a last checkpoint, the final evaluation, and the
        last line with it."""
        from distrain.ps.worker import evaluate_final

        for _ in range(2):  # what was asked before the workers ended, then everything they sent
            self._drain(wait_s=self.spec.start_timeout_s)
        stopped = self.stopping and any(r.get("stopped") for r in results)
        lines = self.log.lines(finished=True)
        last = lines.pop() if lines and lines[-1][0] == self.cfg.trainer.max_steps and not stopped else None
        self._write(lines, save=False)
        self._commit_if_written()
        self._stage()
        val_loss = None
        try:
            if last is not None:
                val_loss = self.group.run(evaluate_final, self.worker_job, ranks=[0])[0]["val_loss"]
        finally:  # the last line and checkpoint, with or without the evaluation
            if last is not None:
                self._write([(last[0], {**last[1], **({"val_loss": val_loss} if val_loss is not None else {})})])
            self._commit_if_written()
        step, line = self.last_line
        first = self.log.first_record_time
        out = run_results(
            self.cfg,
            step,
            line.get("loss"),
            val_loss,
            first - self.started if first else None,
            time.time() - self.begun_at,
            self.cfg.cluster.num_workers,
            self.tracker.wandb_run_id,
            stopped,
        )
        out["ps"] = {"mode": self.cfg.ps.mode, "num_servers": self.cfg.ps.num_servers}
        self.tracker.close(out)
        self.tracker = None
        return out

    def end(self, keep: bool = False) -> None:
        if self.servers is not None:
            self.servers.release() if keep else self.servers.shutdown()
            self.servers = None
        if self.tracker is not None:
            self.tracker.close({})
            self.tracker = None
        if self.staged is not None:  # saved, never committed: not a checkpoint
            shutil.rmtree(self.staged[1], ignore_errors=True)
            self.staged = None

    # -- lines and checkpoints ------------------------------------------------------------------

    def _drain(self, wait_s: float = 0.0) -> None:
        answer = self.servers.drain(wait_s)
        if answer is not None:
            self.log.add(answer["records"], answer["version"], time.time())

    def _write(self, lines: list[tuple[int, dict]], save: bool = True) -> None:
        """Log the finished steps; save the servers when a step crossed a checkpoint interval."""
        t, interval = self.cfg.trainer, self.cfg.checkpoint.interval
        crossed = False
        for step, line in lines:
            crossed |= bool(interval) and step // interval > self.last_line[0] // interval and step < t.max_steps
            if step % t.log_interval == 0 or "val_loss" in line or step == t.max_steps:
                self.tracker.log(step, line)
            self.on_progress(Progress(step=step, max_steps=t.max_steps, metrics=line))
            self.last_line = (step, line)
        if save and crossed:
            self._stage()

    def _stage(self) -> None:
        """The servers save into a staging directory (never loaded); the checkpoint's step is the last
        step every worker has in the weights. Committed by `_commit_if_written` once its lines are."""
        if self.staged is not None:
            return
        staging = self.root / f".saving-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        try:
            applied, files, sums = self.servers.save(staging.name)
            for _ in range(2):  # the records of every step the saved weights hold were on shard 0: take them
                self._drain(wait_s=self.spec.start_timeout_s)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        step = min(applied.values())
        if step <= self.committed:  # nothing new since the last one (the end after a final interval)
            shutil.rmtree(staging, ignore_errors=True)
            return
        self.staged = (step, staging, applied, files, sums)

    def _commit_if_written(self) -> None:
        if self.staged is None or self.log.written < self.staged[0]:
            return
        step, staging, applied, files, sums = self.staged
        meta = {
            "step": step,
            "world_size": self.cfg.cluster.num_workers,
            "config": self.recorded,
            "wandb_run_id": self.tracker.wandb_run_id if self.tracker else self.wandb_run_id,
            "ps": {"applied": applied, "records": self.log.unwritten(step, applied)},
        }
        files = {**files, "the driver": {checkpoint.META_FILE: checkpoint.write_meta(staging, meta)}}
        self.staged = None
        if self.remote is not None:
            if saved.commit_on_store(self.remote, self.servers, staging, step, files, sums, self.cfg.checkpoint.keep):
                self._committed(step)
            return
        staging.rename(checkpoint.prepare(self.root, step))
        checkpoint.commit(self.root, step, files, self.cfg.checkpoint.keep, "the driver")
        self._committed(step)

    def _committed(self, step: int) -> None:
        self.committed = step
        self.log.committed(step)
