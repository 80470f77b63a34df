"""The step loop of collective training (`Trainer.fit`): the rank's state (train/state.py) restored, then each
step trained, logged (train/steplog.py), evaluated, voted on and checkpointed, as named calls. A worker runs it
through `train/rank.py`."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from distrain.channel import Channel, Phase
from distrain.config import ClusterConfig, recorded
from distrain.parallel import process_group
from distrain.storage import checkpoint, remote, saver
from distrain.storage.objectstore import store_for
from distrain.storage.record_sync import record_sync
from distrain.storage.tracking import TRACKER_FILES, Tracker, read_metrics, run_results
from distrain.train import replicas
from distrain.train.faults import AFTER_BACKWARD, AFTER_STEP, Faults
from distrain.train.finite import NonFinite
from distrain.train.job import FromReplicas, RankJob
from distrain.train.learner import Learner
from distrain.train.nvme import NVMeAdamW, nvme_scratch
from distrain.train.optim import build_optimizer, lr_at, set_lr
from distrain.train.state import RankState, seed_rngs, source_of
from distrain.train.steplog import StepLog
from distrain.train.stopvote import StopVote


def outside_steps_timeout_s(c: ClusterConfig) -> float:
    """The collective timeout outside training steps (start-up, checkpoints, evaluation): as long as the
    supervisor lets a rank take there, setup_timeout_s, and no shorter than a step's."""
    return max(c.collective_timeout_s, c.setup_timeout_s)


@contextlib.contextmanager
def outside_steps(c: ClusterConfig) -> Iterator[None]:
    """Collectives outside training steps wait up to outside_steps_timeout_s, as long as the supervisor
    lets a rank take there: one rank slow to write its checkpoint shard (or to load, or to start W&B)
    must not fail the others waiting for it at a barrier. Every rank leaves together, so that the
    next step's collectives, back on cluster.collective_timeout_s, do not wait for a slow one either."""
    process_group.set_timeout(outside_steps_timeout_s(c))
    yield
    dist.barrier()
    process_group.set_timeout(c.collective_timeout_s)


class Trainer:
    """One rank's step loop around its training state (`RankState`) and its step log (`StepLog`)."""

    def __init__(self, job: RankJob, device: torch.device, channel: Channel):
        cfg, layout = job.config, job.layout
        self.cfg, self.layout, self.device, self.channel, self.job = cfg, layout, device, channel, job
        # On an object store, this node's own mirror of the run (the driver's is on its node).
        self.run_dir, self.started_at = Path(cfg.run_dir if cfg.run_url else job.run_dir), job.started_at
        # What checkpoints and the tracker record: config.to_plain's dict, without its OmegaConf (0.2 s here).
        self.plain_config = recorded(dataclasses.asdict(cfg))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        assert layout.world_size == self.world, f"{layout} does not cover the {self.world} ranks"
        self.said: list[str] = []
        seed_rngs(cfg.trainer.seed, layout.coordinate(self.rank)["pp"])  # a resume sets them again below
        faults = Faults(cfg.fault, self.rank, channel)
        self.learner = Learner(cfg, layout, layout.data_shard(self.rank), device, faults)
        with outside_steps(cfg.cluster):  # the mesh's groups now exist: they get start-up's timeout too
            optimizer = build_optimizer(
                self.learner.module, cfg.optim, self.learner.parallel.zero1_group, nvme_scratch(cfg, self.rank)
            )
            # With an object store, each rank uploads what it wrote; the store's copy is the one committed.
            store = cfg.run_url and remote.Remote(
                store_for(cfg.run_url, cfg.storage),
                lambda step: faults.kill_uploading(step, self.resumed_at),
                self.say,
            )
            self.saver = saver.Saver(
                self.run_dir / "checkpoints",
                cfg.checkpoint.keep,
                # Staging a background save copies the state into host memory, which NVMe offload keeps it out of.
                background=cfg.checkpoint.async_save and cfg.strategy.offload != "nvme",
                pin=device.type == "cuda",
                timeout_s=outside_steps_timeout_s(cfg.cluster),
                remote=store or None,
            )
            self.state = RankState(self.learner, optimizer, device, layout, self.rank)
            self.state.restore(source_of(job.start, store or None, self.run_dir, faults.kill_mid_transfer))
            self.resumed_at = self.state.step
            self.learner.settle(self.state.step + 1)
            self.tracker = self.open_tracker(store or None)
        routers = self.learner.parallel.routers
        self.log = StepLog(
            cfg, device, self.learner.precision, self.world, self.tracker, channel, self.mean_of, routers.describe
        )
        self.vote = StopVote()
        # Under way: what a recovery from replicas started from is in this attempt's model now. (Kept until here,
        # untouched: if this attempt fails before it gets here, a kill mid-transfer, the next starts from it again.)
        replicas.keep(None)
        # `logged`: the step the progress line shows, with its figures once read back (log_read)
        step = self.state.step
        channel.report(step=step, logged=step, max_steps=cfg.trainer.max_steps, loaded_at=time.time())

    def open_tracker(self, store: remote.Remote | None) -> Tracker | None:
        """Rank 0's metrics, W&B and TensorBoard, with the lines the survivors of a recovery from replicas read back
        that the rank that died may not have written."""
        if self.rank != 0:
            return None
        record = record_sync(self.cfg, self.run_dir, TRACKER_FILES)  # a run on an object store
        tracker = Tracker(str(self.run_dir), self.plain_config, self.state.step, self.job.wandb_run_id, record)
        if store and record is not None:  # the record on the store at least at every commit
            store.on_commit = lambda step: record.try_sync(self.say)
        start = self.job.start
        if isinstance(start, FromReplicas):
            written = {m["step"] for m in read_metrics(str(self.run_dir))}
            for step in sorted(set(start.lines) - written):
                tracker.log(step, start.lines[step])
        return tracker

    # -- the loop -------------------------------------------------------------------------------

    def fit(self) -> dict:
        """The step loop. Nothing in a step waits on the host for the device or for other ranks beyond the
        gradient's own collectives: a logged step's loss and gradient norm are read back once the next step
        has been queued (`StepLog`), the stop vote is counted a step after it is cast (`StopVote`),
        inputs are prepared a step ahead (`Prefetch`) and checkpoints are written in the background
        (`saver.Saver`)."""
        t, state = self.cfg.trainer, self.state
        self.fit_start = time.perf_counter()
        self.first_step_s, self.val_loss, stopped = None, None, False
        self.nonfinite = NonFinite(self.device)
        self.log.open()
        self.began = state.step
        while state.step < t.max_steps:
            state.step += 1
            last = state.step == t.max_steps
            loss_sum, grad_norm = self.train_step()
            self.note_first_step()
            self.log_and_evaluate(loss_sum, grad_norm, last)
            self.channel.report(phase=Phase.TRAIN, step=state.step, max_steps=t.max_steps)
            self.saver.check()
            stopped = self.checkpoint_if_due(last)
            self.learner.faults.kill(AFTER_STEP, state.step, self.began, settle=self.log.settle)
            if stopped:
                break
        return self.wind_down(stopped and state.step < t.max_steps)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over this rank's micro-batches, the gradient all-reduced on the way, and one
        optimizer update; the summed micro-batch losses (local) and the gradient norm before clipping."""
        state, step = self.state, self.state.step
        self.channel.report(began=step)
        set_lr(state.optimizer, lr_at(step, self.cfg.optim, self.cfg.trainer.max_steps))
        loss_sum = self.learner.forward_backward(step)
        self.learner.faults.kill(AFTER_BACKWARD, step, self.began, settle=self.log.settle)
        grad_norm = self.learner.parallel.clip_grad_norm(self.cfg.optim.grad_clip)
        self.nonfinite.watch(step, loss_sum, grad_norm)
        # The last logged step's line, read back now (its sum over the ranks has had this step's compute to
        # arrive) and before this update: a rank that dies once the update is done cannot take it with it.
        self.log_read()
        with state.updating():
            state.optimizer.step()
            self.learner.faults.fail_in_update(step, self.began)
        state.optimizer.zero_grad(set_to_none=True)
        self.log.window.steps += 1
        return loss_sum, grad_norm

    def note_first_step(self) -> None:
        if self.first_step_s is None:
            self.first_step_s = time.time() - self.started_at
            self.channel.report(first_step_at=time.time())

    def log_and_evaluate(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor, last: bool) -> None:
        """Close the logging window at a logged step, and evaluate at an evaluation step (the last is both)."""
        t, step = self.cfg.trainer, self.state.step
        evaluate_now = (t.eval_interval > 0 and step % t.eval_interval == 0) or last
        if step % t.log_interval == 0 or evaluate_now:
            lr, figures = self.state.optimizer.param_groups[0]["lr"], self.learner.parallel.step_figures
            self.log.close(step, lr, loss_sum, grad_norm, figures, self.saver)
        if evaluate_now:
            self.val_loss = self.evaluate()
            self.log_read(val_loss=self.val_loss)

    def checkpoint_if_due(self, last: bool) -> bool:
        """Save at checkpoint.interval and at the last step, and at a stop if a save fits before its deadline;
        whether the ranks agreed to stop."""
        stopped, save_fits = self.vote.count(self.channel.stop_deadline, self.saver.last_save_s, last)
        interval, step = self.cfg.checkpoint.interval, self.state.step
        if (interval and step % interval == 0) or last:
            self.checkpoint(wait=last or stopped)
        elif stopped and save_fits:
            self.checkpoint(wait=True)
        return stopped

    def wind_down(self, stopped: bool) -> dict:
        """After the last step: no collective left in flight, the last line logged, the saves closed."""
        self.vote.close()
        self.log_read()
        self.check_finite()  # a run stopped between its saves ends "stopped" only if it trained on numbers
        self.saver.close()
        if isinstance(self.state.optimizer, NVMeAdamW):
            self.state.optimizer.close()  # its files are scratch: the checkpoint holds the state
        return self.finish(stopped)

    def log_read(self, **extra: float) -> None:
        """Log the step the step log left in flight, if any, with `extra` figures (its validation loss)."""
        line = self.log.read(**extra)
        if line is None:
            return
        self.state.loss = line["loss"]
        if not (math.isfinite(line["loss"]) and math.isfinite(line["grad_norm"])):  # the same on every rank: reduced
            self.check_finite()

    def check_finite(self) -> None:
        """Collective: end the run, on every rank, if a step's loss or gradient norm was not finite."""
        self.nonfinite.check(self.cfg, self.device.type == "cuda")

    def finish(self, stopped: bool) -> dict:
        wandb_run_id = self.tracker.wandb_run_id if self.tracker is not None else None
        results = run_results(
            self.cfg,
            self.state.step,
            self.state.loss,
            self.val_loss,
            self.first_step_s,
            time.perf_counter() - self.fit_start,
            self.world,
            wandb_run_id,
            stopped,
        )
        if self.tracker is not None:
            self.tracker.close(results)
        return results if self.rank == 0 else {}

    # -- reductions over the ranks, outside steps -----------------------------------------------

    def global_mean(self, local_sum: torch.Tensor) -> float:
        """Mean over the global batch of per-micro-batch means (equal sizes, so the batch mean), from the
        local sums of the micro-batch losses; `mean_of` gives it from their sum over the ranks."""
        total = local_sum.detach().clone()
        dist.all_reduce(total)
        return self.mean_of(total.item())

    def mean_of(self, total: float) -> float:
        """Every rank that computes a loss (tensor-parallel peers hold the same one; ranks without the last
        pipeline stage hold none and add zero) is counted once per micro-batch."""
        return total / (self.layout.micro_batches * self.layout.loss_holders)

    def evaluate(self) -> float:
        self.channel.report(phase=Phase.EVAL)
        with self.outside_steps():
            val_loss = self.global_mean(self.learner.evaluate()) / self.cfg.trainer.eval_batches
        self.channel.report(phase=Phase.TRAIN)
        return val_loss

    @contextlib.contextmanager
    def outside_steps(self) -> Iterator[None]:
        """`outside_steps`, its time taken out of the logging window's: not training time."""
        start = time.perf_counter()
        with outside_steps(self.cfg.cluster):
            yield
        self.log.pause(time.perf_counter() - start)

    # -- checkpoints and recovery ---------------------------------------------------------------

    def say(self, line: str) -> None:
        """A line of this rank's for the user: on its stderr, and up to the driver, which prints rank 0's."""
        checkpoint.say(line)
        self.said.append(line)
        self.channel.report(said=tuple(self.said))

    def checkpoint(self, wait: bool) -> None:
        """Save (in the background with checkpoint.async), telling the supervisor that this rank is saving
        (slow, not hung) while the step waits for it; `wait`: until it has committed. The step's metrics
        line is written first: a run resumed from this checkpoint starts at the next step and would never
        write it."""
        self.log_read()
        self.channel.report(phase=Phase.CHECKPOINT)
        start = time.perf_counter()
        with self.outside_steps():
            self.check_finite()  # never a checkpoint of NaN weights
            wandb_run_id = self.tracker.wandb_run_id if self.tracker is not None else None
            # `config` and `base` (a LoRA run's base model): what a resume is checked against
            recorded = {"config": self.plain_config, "wandb_run_id": wandb_run_id, "base": self.job.base}
            self.state.save(self.saver, self.cfg.trainer.seed, recorded)
            if wait:
                self.saver.wait()
        self.log.blocked_s += time.perf_counter() - start  # what a background save saves, per save (checkpoint_block_s)
        self.channel.report(phase=Phase.TRAIN)

    def kept(self) -> replicas.KeptState | None:
        """What this rank keeps in memory when its attempt fails, for the next one to start from: its state, if a
        replica could start from it, with the last logged steps' lines it read back."""
        if not self.state.keepable(self.cfg.cluster):
            return None
        return self.state.kept(self.job.run_id, self.world, self.log.lines(self.state.committed))
