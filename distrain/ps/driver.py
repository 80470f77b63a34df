"""The driver of a parameter-server run: servers and workers placed, watched and kept going.

A worker that dies, raises or hangs is replaced in its own bundle while the others go on (in
sync mode the open round waits for the replacement, which recomputes the missing gradient; with
backup workers it need not). A server that dies or stops answering takes the run back to the
newest committed checkpoint: servers restored, workers restarted, as a new attempt. Both spend
the failure budget, `cluster.max_failures`. Rank 0's role in the other strategies (metrics.jsonl,
W&B, checkpoints, the progress line) is the driver's here: no worker is special.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from ray.exceptions import RayActorError, RayError

from distrain import checkpoint
from distrain.cluster.attempt import Attempt, Heartbeats, mask, write_placement, write_stacks
from distrain.cluster.placement import GroupSpec, WorkerFailure
from distrain.cluster.policy import Policy
from distrain.cluster.worker_group import WorkerGroup, first_line
from distrain.config import TrainConfig, to_plain
from distrain.model.size import flops_per_token, num_params
from distrain.ps.metrics import StepLog
from distrain.ps.server_group import ServerGroup, ServerLost
from distrain.ps.worker import evaluate_final, run_worker
from distrain.tracking import Tracker


class ParameterServerRun:
    def __init__(
        self,
        cfg: TrainConfig,
        spec: GroupSpec,
        policy: Policy,
        run_dir: Path,
        wandb_run_id: str | None,
        started: float,
        on_progress: Callable[[dict], None] = lambda progress: None,
        on_event: Callable[[str], None] = lambda message: None,
    ):
        self.cfg, self.spec, self.policy, self.run_dir = cfg, spec, policy, run_dir
        self.plain = to_plain(cfg)
        self.wandb_run_id, self.started = wandb_run_id, started
        self.on_progress, self.on_event = on_progress, on_event
        self.attempts: list[Attempt] = []
        self.replacements: list[dict] = []
        self.failures = 0
        self.last_signature: str | None = None
        self.stop_requested_at: float | None = None
        self.servers: ServerGroup | None = None
        self.group: WorkerGroup | None = None
        self.tracker: Tracker | None = None
        # Per attempt (set by _start):
        self.steps: StepLog | None = None  # the workers' records, turned into lines
        self.last_line: tuple[int, dict] = (0, {})  # the newest step logged, and its line
        self.checkpointed = 0  # the step of the newest committed checkpoint
        self.worker_job: dict = {}

    @property
    def restarts(self) -> int:
        return len(self.replacements) + max(len(self.attempts) - 1, 0)

    def request_stop(self) -> None:
        self.stop_requested_at = self.stop_requested_at or time.time()

    def run(self) -> list[dict]:
        """[the run's results], as rank 0 returns them under the other strategies."""
        since = time.time()
        try:
            while True:
                attempt = self._start(since)
                try:
                    return [self._watch(attempt)]
                except ServerLost as e:
                    since = time.time()
                    attempt.outcome, attempt.cause, attempt.step_reached = "failed", str(e), self.last_line[0]
                    self._write_lines(self.steps.lines(upto=self.checkpointed), checkpoints=False)
                    self._spend(str(e), None)
                    self.on_event(f"{e}; restoring the servers from the last checkpoint")
                    self._teardown()
        finally:
            self._teardown()

    # -- starting -------------------------------------------------------------------------------

    def _start(self, since: float) -> Attempt:
        latest = checkpoint.latest(self.run_dir / "checkpoints")
        resume_step = checkpoint.read_meta(latest)["step"] if latest else 0
        job = {"config": self.plain, "resume_from": str(latest) if latest else None}
        w, s = self.cfg.cluster.num_workers, self.cfg.strategy.num_servers
        self.servers = ServerGroup(job, s, w, self.spec.cpus_per_worker, self.policy.setup_timeout_s)
        servers = self.servers.start()
        self.group = WorkerGroup(self.spec)
        table = self.group.start()
        attempt = Attempt(len(self.attempts) + 1, w, {"resumed_from_step": resume_step}, {"since": since})
        attempt.timings["placed_at"] = time.time()
        self.attempts.append(attempt)
        write_placement(self.run_dir, attempt.number, table + [{"server": k, **i} for k, i in enumerate(servers)])
        self.tracker = Tracker(str(self.run_dir), self.plain, resume_step, self.wandb_run_id)
        self.steps = StepLog(self.cfg, resume_step)
        self.last_line, self.checkpointed = (resume_step, {}), resume_step
        self.worker_job = {"config": self.plain, "servers": self.servers.actors}
        self.group.launch(run_worker, self.worker_job)
        return attempt

    def _teardown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        if self.servers is not None:
            self.servers.shutdown()
            self.servers = None
        if self.tracker is not None:
            self.tracker.close({})
            self.tracker = None

    # -- watching -------------------------------------------------------------------------------

    def _watch(self, attempt: Attempt) -> dict:
        group = self.group
        beats = Heartbeats(len(group.workers), [])
        done: dict[int, dict] = {}
        stopping = False
        while len(done) < len(group.workers):
            for rank, value, error in group.poll(self.policy.poll_s):
                if error is None:
                    done[rank] = value
                else:
                    self._worker_failed(rank, error)
            self._drain()
            self._write_lines(self.steps.lines())
            progress = group.progress()
            beats.update(progress)
            for rank, p in enumerate(progress):
                if rank not in done and beats.silent_s(rank) > self._hang_limit(p):
                    self._worker_hung(rank, beats.silent_s(rank), p)
                    beats.changed[rank] = time.monotonic()
            if self.stop_requested_at and not stopping:
                stopping = True
                self.on_event(
                    "stop requested: the workers stop at their next server call; checkpointing, then stopping"
                )
                self.servers.call("stop")
        return self._finish(attempt, done)

    def _drain(self, wait_s: float = 0.0) -> None:
        answer = self.servers.drain(wait_s)
        if answer is not None:
            self.steps.add(answer["records"], answer["version"], time.time())

    def _write_lines(self, lines: list[tuple[int, dict]], checkpoints: bool = True) -> None:
        """Log the finished steps, then checkpoint the servers if a step crossed an interval."""
        t, interval = self.cfg.trainer, self.cfg.checkpoint.interval
        crossed = False
        for step, line in lines:
            crossed |= bool(interval) and step // interval > self.last_line[0] // interval and step < t.max_steps
            if step % t.log_interval == 0 or "val_loss" in line or step == t.max_steps:
                self.tracker.log(step, line)
            self.on_progress({"step": step, "max_steps": t.max_steps, **line})
            self.last_line = (step, line)
        if checkpoints and crossed:
            self._checkpoint()

    def _hang_limit(self, progress: dict) -> float:
        """Waiting on a server is not a hang (a lost server is caught by its drains); a step is
        given hang_timeout_s (default: HANG_STEPS recent step times, at least min_hang_timeout_s), anything
        else setup_timeout_s."""
        phase = progress.get("phase")
        if phase == "wait":
            return float("inf")
        if phase != "train":
            return self.policy.setup_timeout_s
        return self.policy.step_limit(self.steps.step_time_s())

    # -- failures -------------------------------------------------------------------------------

    def _worker_failed(self, rank: int, error: RayError) -> None:
        self.servers.check(timeout_s=self.policy.survivor_grace_s)  # a worker's failure may be a server's
        signature = None if isinstance(error, RayActorError) else mask(first_line(error))
        self._replace(rank, f"{self.group.who(rank)} failed: {first_line(error)}", signature, str(error))

    def _worker_hung(self, rank: int, silent_s: float, progress: dict) -> None:
        folder = write_stacks(self.run_dir, self.attempts[-1].number, {rank: self.group.stacks()[rank]})
        cause = f"{self.group.who(rank)} made no progress for {silent_s:.1f} s (at step {progress.get('step')})"
        self._replace(rank, f"{cause}; stacks in {folder}", None, None)

    def _replace(self, rank: int, cause: str, signature: str | None, error: str | None) -> None:
        self._spend(cause, signature, error)
        self.on_event(f"{cause}; replacing it while the others go on (failure {self.failures})")
        self.servers.forget(rank)
        self.group.replace(rank)
        self.group.launch(run_worker, self.worker_job, ranks=[rank])
        self.replacements.append(
            {"worker": rank, "cause": cause, "at_step": self.steps.reached[rank], "time": time.time()}
        )

    def _spend(self, cause: str, signature: str | None, error: str | None = None) -> None:
        """One unit of the failure budget; the same error twice in a row fails the run at once."""
        self.failures += 1
        if signature is not None and signature == self.last_signature:
            raise WorkerFailure(f"the same error twice, so retrying cannot help: {cause}\n{error}")
        self.last_signature = signature
        self.policy.check_budget(self.failures, cause, error)

    # -- finishing ------------------------------------------------------------------------------

    def _finish(self, attempt: Attempt, done: dict[int, dict]) -> dict:
        """Every worker returned: the last records, the final evaluation, the last checkpoint."""
        t = self.cfg.trainer
        for _ in range(2):  # what was asked before the workers ended, then everything they sent
            self._drain(wait_s=self.policy.setup_timeout_s)
        stopped = any(r.get("stopped") for r in done.values()) and bool(self.stop_requested_at)
        lines = self.steps.lines(finished=True)
        last = lines.pop() if lines and lines[-1][0] == t.max_steps and not stopped else None  # gets val_loss
        self._write_lines(lines, checkpoints=False)
        self._checkpoint()  # before the evaluation: a failure there loses nothing
        val_loss = None
        try:
            if not stopped:
                val_loss = self.group.run(evaluate_final, self.worker_job, ranks=[0])[0]["val_loss"]
        finally:
            if last is not None:
                self._write_lines([(last[0], {**last[1], **({"val_loss": val_loss} if val_loss is not None else {})})])
        step, line = self.last_line
        attempt.outcome = "stopped" if stopped else "completed"
        attempt.step_reached = step
        results = {
            "final_step": step,
            "final_loss": line.get("loss"),
            "final_val_loss": val_loss,
            "first_step_s": (self.steps.first_record_time - self.started) if self.steps.first_record_time else None,
            "train_s": time.time() - attempt.timings["placed_at"],
            "world_size": self.cfg.cluster.num_workers,
            "num_params": num_params(self.cfg.model),
            "flops_per_token": flops_per_token(self.cfg.model, t.seq_len),
            "wandb_run_id": self.tracker.wandb_run_id,
            "stopped": stopped,
            "ps": {
                "mode": self.cfg.strategy.mode,
                "num_servers": self.cfg.strategy.num_servers,
                "replacements": self.replacements,
            },
        }
        self.tracker.close(results)
        self.tracker = None
        return results

    def _checkpoint(self) -> None:
        meta = {
            "loss": self.last_line[1].get("loss"),
            "world_size": self.cfg.cluster.num_workers,
            "config": self.plain,
            "wandb_run_id": self.tracker.wandb_run_id,
        }
        root = self.run_dir / "checkpoints"
        self.checkpointed = self.servers.save(root, self.checkpointed, meta, self.cfg.checkpoint.keep)
