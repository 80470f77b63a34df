"""One rank of collective training: process group → Learner (model, layout, data shard) → step loop
→ metrics and checkpoints.

`run_rank` is what a worker executes. It knows torch.distributed (through `distrain.parallel`)
and nothing about Ray: it joins the process group from torchrun-style environment variables,
reports progress through the channel it is given, and reads a stop request from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import secrets
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from distrain.channel import Channel, Phase
from distrain.config import ClusterConfig, TrainConfig, recorded
from distrain.data.loader import run_batches
from distrain.model.size import flops_per_token
from distrain.parallel import process_group
from distrain.storage import checkpoint, remote, saver
from distrain.storage.objectstore import store_for
from distrain.storage.record_sync import record_sync
from distrain.storage.safeload import DamagedCheckpointError
from distrain.storage.tracking import TRACKER_FILES, Tracker, read_metrics, run_results
from distrain.train import peers
from distrain.train.faults import AFTER_BACKWARD, AFTER_STEP, Faults
from distrain.train.finite import NonFinite
from distrain.train.job import PeerPlan, RankJob
from distrain.train.learner import Learner
from distrain.train.metrics import Readback, memory_peaks, peak_flops
from distrain.train.nvme import NVMeAdamW, Scratch
from distrain.train.optim import build_optimizer, local_optimizer, lr_at, set_lr

STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def run_rank(job: RankJob, channel: Channel) -> dict:
    """Train this rank's part of the run `job` describes; rank 0 returns the run's results, the others an
    empty dict. The results say `stopped` when a stop request ended the run before max_steps.

    The trainer is gone before the groups it used are let go (`process_group.release`): a DDP reducer
    left as the last holder of its group would hang the rank as it let go (docs/architecture.md, pitfalls)."""
    channel.report({"phase": Phase.JOIN})
    if job.peers is None:
        peers.keep(None)  # what an earlier attempt kept here is not needed: let its memory go
    device = process_group.init_from_env(outside_steps_timeout_s(job.config.cluster), job.use_gpu)
    channel.report({"phase": Phase.SETUP, "joined_at": time.time()})
    try:
        results = run_trainer(job, device, channel)
    except BaseException as failure:
        returning(channel, "leaving its process group")
        process_group.abort()  # a graceful destroy would wait for collectives its peers may never join
        time.sleep(job.config.fault.slow_return_s)
        traceback.clear_frames(failure.__traceback__)  # the failed frames' hold on the trainer
        raise
    else:
        process_group.destroy()
    finally:
        gc.collect()  # the trainer, while the ended groups are still held
        process_group.release()
    return results


def run_trainer(job: RankJob, device: torch.device, channel: Channel) -> dict:
    """Build the trainer and run it; if it fails, keep what a live replica recovers from (nothing unless
    whole) before the failure goes on."""
    trainer = None
    try:
        trainer = Trainer(job, device, channel)
        return trainer.fit()
    except BaseException:
        if trainer is not None:
            returning(channel, "keeping its state for a recovery from replicas")
            try:
                peers.keep(trainer.held())
            except Exception as e:  # never in the way of the failure itself: the next attempt loads the checkpoint
                peers.keep(None)
                checkpoint.say(f"rank {trainer.rank} keeps no state for a recovery from replicas: {e}")
        raise


def returning(channel: Channel, doing: str) -> None:
    """Tell the supervisor this rank has seen its attempt fail and is on its way back, doing what: it waits
    for such a rank however slow (a survivor it ended would take its state with it)."""
    channel.report({"returning": doing})


def rng_states(device: torch.device) -> dict:
    """This process's random number generators' states: a checkpoint's per-rank state, a replica's."""
    states = {"cpu_rng": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda_rng"] = torch.cuda.get_rng_state(device)
    return states


def seed_rngs(seed: int, stage: int) -> None:
    """Seed this process's generators for a fresh start from the run's seed and the rank's pipeline stage: a run
    draws the same numbers whatever ran in its worker before (warm workers are reused), and every rank of a stage
    draws alike (as torchtitan and Megatron-LM seed data parallelism), so the generators a replacement
    takes from a replica are the ones the rank it replaces had."""
    torch.manual_seed(seed + stage * 2**32)


def set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["cpu_rng"])
    if "cuda_rng" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda_rng"], device)


def outside_steps_timeout_s(c: ClusterConfig) -> float:
    """The collective timeout outside training steps (start-up, checkpoints, evaluation): as long as the
    supervisor lets a rank take there, setup_timeout_s, and no shorter than a step's."""
    return max(c.collective_timeout_s, c.setup_timeout_s)


def checkpoint_state(learner: Learner, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """What a checkpoint holds, and the hyperparameters it leaves out. Keyed by full-model parameter
    name, whatever the layout: a checkpoint resumes on any. Optimizer state is flattened to one
    entry per parameter so that ranks holding different parameters (pipeline stages, ZeRO-1
    shards) contribute disjoint keys. Its `param_groups.*` entries (lr, betas, eps, weight decay:
    one small item per parameter and key, most of what a load reads) are not saved: the config
    says them, and the schedule sets lr every step."""
    model_sd, optim_sd = get_state_dict(learner.module, local_optimizer(optimizer), options=STATE_OPTIONS)
    groups = {k: optim_sd.pop(k) for k in [k for k in optim_sd if k.startswith("param_groups.")]}
    return {"model": model_sd, "optim": learner.parallel.checkpoint_names(optim_sd, saving=True)}, groups


def nvme_scratch(cfg: TrainConfig, rank: int) -> Scratch | None:
    """Where this rank's optimizer state lives under offload=nvme, else None."""
    s = cfg.strategy
    if s.offload != "nvme":
        return None
    root, run = os.path.split(s.nvme_directory(cfg.run.name))
    # A directory of its own (<rank>.<pid>-<tag>): a process kept from a failed attempt may not have removed
    # its last one yet (train/nvme.py).
    own = f"rank_{rank:05d}.{os.getpid()}-{secrets.token_hex(4)}"
    return Scratch(Path(root), os.path.join(run, own), int(s.nvme_buffer_mb * 2**20))


def warm_up(cfg: TrainConfig) -> None:
    """What a hot spare does while it waits for a rank: this module's imports (torch and the whole
    trainer, loaded as this function arrives), what torch imports on first use (DDP imports dynamo
    as it is built: 1.3 s), and the run's corpus, so that taking over costs none of them."""
    import torch._dynamo  # noqa: F401

    run_batches(cfg)


class Trainer:
    def __init__(self, job: RankJob, device: torch.device, channel: Channel):
        cfg, layout = job.config, job.layout
        self.cfg, self.layout, self.device, self.channel = cfg, layout, device, channel
        # On an object store, this node's own mirror of the run (the driver's is on its node).
        self.run_dir, self.started_at = Path(cfg.run_dir if cfg.run_url else job.run_dir), job.started_at
        # What checkpoints and the tracker record: config.to_plain's dict, without its OmegaConf (0.2 s here).
        self.plain_config = recorded(dataclasses.asdict(cfg))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        assert layout.world_size == self.world, f"{layout} does not cover the {self.world} ranks"
        self.window = [time.perf_counter(), 0]  # when this logging window's training began, and its steps
        self.said: list[str] = []
        seed_rngs(cfg.trainer.seed, layout.coordinate(self.rank)["pp"])  # a resume sets them again below
        faults = Faults(cfg.fault, self.rank, channel)
        self.learner = Learner(cfg, layout, layout.data_shard(self.rank), device, faults)
        with self.outside_steps():  # the mesh's groups now exist: they get start-up's timeout too
            self.optimizer = build_optimizer(
                self.learner.module, cfg.optim, self.learner.parallel.zero1_group, nvme_scratch(cfg, self.rank)
            )
            self.step, self.loss = 0, math.nan
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
            self.job = job
            if job.peers is not None:
                self.load_from_peers(job.peers)
            elif job.resume_from:
                self.load(job.resume_from)
            self.resumed_at = self.done = self.step  # `done`: the last step whose optimizer update finished
            self.rng = rng_states(device)  # as they were when step `done` ended
            self.learner.settle(self.step + 1)
            self.tracker = None
            if self.rank == 0:
                record = record_sync(cfg, self.run_dir, TRACKER_FILES)  # a run on an object store
                self.tracker = Tracker(str(self.run_dir), self.plain_config, self.step, job.wandb_run_id, record)
                if store and record is not None:  # the record on the store at least at every commit
                    store.on_commit = lambda step: record.try_sync(self.say)
                if job.peers:  # lines read back by survivors, which the rank that died may not have written
                    written = {m["step"] for m in read_metrics(str(self.run_dir))}
                    for step in sorted(set(job.peers.lines) - written):
                        self.tracker.log(step, job.peers.lines[step])
        self.vote: tuple[dist.Work, torch.Tensor] | None = None  # the stop vote in flight (agree_on_stop)
        self.blocked_s = 0.0  # how long checkpoints held the loop up since the last logged step
        # Under way: what a recovery from replicas started from is in this attempt's model now. (Kept until here,
        # untouched: if this attempt fails before it gets here, a kill mid-transfer, the next starts from it again.)
        peers.keep(None)
        # `logged`: the step the progress line shows, with its figures once read back (log_read)
        channel.report(
            {"step": self.step, "logged": self.step, "max_steps": cfg.trainer.max_steps, "loaded_at": time.time()}
        )

    # -- reductions over the ranks ----------------------------------------------------------------

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
        self.channel.report({"phase": Phase.EVAL})
        with self.outside_steps():
            val_loss = self.global_mean(self.learner.evaluate()) / self.cfg.trainer.eval_batches
        self.channel.report({"phase": Phase.TRAIN})
        return val_loss

    @contextlib.contextmanager
    def outside_steps(self) -> Iterator[None]:
        """Collectives outside training steps wait up to outside_steps_timeout_s, as long as the supervisor
        lets a rank take there: one rank slow to write its checkpoint shard (or to load, or to start W&B)
        must not fail the others waiting for it at a barrier. Every rank leaves together, so that the
        next step's collectives, back on cluster.collective_timeout_s, do not wait for a slow one either."""
        start = time.perf_counter()
        process_group.set_timeout(outside_steps_timeout_s(self.cfg.cluster))
        yield
        dist.barrier()
        process_group.set_timeout(self.cfg.cluster.collective_timeout_s)
        self.window[0] += time.perf_counter() - start  # not training time

    # -- the loop -------------------------------------------------------------------------------

    def fit(self) -> dict:
        """The step loop. Nothing in a step waits on the host for the device or for other ranks beyond the
        gradient's own collectives: a logged step's loss and gradient norm are read back once the next step
        has been queued (`Readback`), the stop vote is counted a step after it is cast (`agree_on_stop`),
        inputs are prepared a step ahead (`Prefetch`) and checkpoints are written in the background
        (`saver.Saver`)."""
        t = self.cfg.trainer
        self.fit_start = time.perf_counter()
        peak = peak_flops(self.device, self.learner.precision)  # a logged step's FLOP/s as MFU: once, here
        self.flops_to_mfu = flops_per_token(self.cfg.model, t.seq_len) / (peak * self.world) if peak else None
        self.window = [time.perf_counter(), 0]
        self.unread: tuple[int, dict, Readback] | None = None  # a logged step whose scalars are in flight
        self.last_read: dict[int, dict] = {}  # the last logged step read back (every rank: for a recovery)
        self.first_step_s, self.val_loss, stopped = None, None, False
        self.nonfinite = NonFinite(self.device)
        memory_peaks(self.device, reset=True)
        began = self.step

        while self.step < t.max_steps:
            self.step += 1
            self.channel.report({"began": self.step})
            # Forward and backward over this rank's micro-batches, the gradient all-reduced on the way;
            # the summed micro-batch losses (local) and the norm before clipping; one optimizer step.
            set_lr(self.optimizer, lr_at(self.step, self.cfg.optim, t.max_steps))
            loss_sum = self.learner.forward_backward(self.step)
            self.learner.faults.kill(AFTER_BACKWARD, self.step, began, settle=self.finish_readback)
            grad_norm = self.learner.parallel.clip_grad_norm(self.cfg.optim.grad_clip)
            self.nonfinite.watch(self.step, loss_sum, grad_norm)
            # The last logged step's line, read back now (its sum over the ranks has had this step's compute to
            # arrive) and before this update: a rank that dies once the update is done cannot take it with it.
            self.log_read()
            self.done = None  # inside the update: a failure now leaves no whole state
            self.optimizer.step()
            self.learner.faults.fail_in_update(self.step, began)
            self.done, self.rng = self.step, rng_states(self.device)
            self.optimizer.zero_grad(set_to_none=True)
            self.window[1] += 1
            if self.first_step_s is None:
                self.first_step_s = time.time() - self.started_at
                self.channel.report({"first_step_at": time.time()})
            last = self.step == t.max_steps
            evaluate_now = (t.eval_interval > 0 and self.step % t.eval_interval == 0) or last
            if self.step % t.log_interval == 0 or evaluate_now:
                self.log_started(loss_sum, grad_norm)
            if evaluate_now:
                self.val_loss = self.evaluate()
                self.log_read(val_loss=self.val_loss)
            self.channel.report({"phase": Phase.TRAIN, "step": self.step, "max_steps": t.max_steps})
            self.saver.check()
            stopped, save_fits = self.agree_on_stop(last)
            if (self.cfg.checkpoint.interval and self.step % self.cfg.checkpoint.interval == 0) or last:
                self.checkpoint(wait=last or stopped)
            elif stopped and save_fits:
                self.checkpoint(wait=True)
            self.learner.faults.kill(AFTER_STEP, self.step, began, settle=self.finish_readback)
            if stopped:
                break
        if self.vote is not None:
            self.vote[0].wait()  # no collective is left in flight
        self.log_read()
        self.check_finite()  # a run stopped between its saves ends "stopped" only if it trained on numbers
        self.saver.close()
        if isinstance(self.optimizer, NVMeAdamW):
            self.optimizer.close()  # its files are scratch: the checkpoint holds the state
        return self.finish(stopped and self.step < t.max_steps)

    def log_started(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Close this logging window: its figures now, its loss and gradient norm on their way to the host."""
        t = self.cfg.trainer
        elapsed = time.perf_counter() - self.window[0]
        tokens_per_s = t.global_batch_size * t.seq_len * self.window[1] / elapsed
        metrics = {
            "lr": self.optimizer.param_groups[0]["lr"],
            "tokens_per_s": tokens_per_s,
            "step_time_s": elapsed / self.window[1],
            **memory_peaks(self.device, reset=True),
        }
        if self.flops_to_mfu is not None:
            metrics["mfu"] = self.flops_to_mfu * tokens_per_s
        if self.blocked_s:  # logged with the next step: the saving step's line is written before its save
            metrics["checkpoint_block_s"], self.blocked_s = self.blocked_s, 0.0
        store = self.saver.remote
        if store is not None and store.upload_s is not None:  # a commit on the store since the last line
            metrics["checkpoint_upload_s"], store.upload_s = store.upload_s, None
        self.unread = (self.step, metrics, Readback(loss_sum, grad_norm))
        self.window = [time.perf_counter(), 0]

    def finish_readback(self) -> None:
        """Wait until the logged step in flight has its loss summed over the ranks, without logging it."""
        if self.unread is not None:
            self.unread[2].read()

    def log_read(self, **extra: float) -> None:
        """Log the step `log_started` left in flight, if any, with `extra` figures (its validation loss)."""
        if self.unread is None:
            return
        step, metrics, readback = self.unread
        self.unread = None
        loss_total, grad_norm = readback.read()
        self.loss = self.mean_of(loss_total)
        metrics = {"loss": self.loss, "grad_norm": grad_norm, **metrics, **extra}
        self.last_read = {step: metrics}
        if self.tracker is not None:
            self.tracker.log(step, metrics)
        self.channel.report({**metrics, "logged": step})  # the progress line shows these beside their step
        if not (math.isfinite(loss_total) and math.isfinite(grad_norm)):  # the same on every rank: reduced
            self.check_finite()

    def check_finite(self) -> None:
        """Collective: end the run, on every rank, if a step's loss or gradient norm was not finite."""
        self.nonfinite.check(self.cfg, self.device.type == "cuda")

    def finish(self, stopped: bool) -> dict:
        wandb_run_id = self.tracker.wandb_run_id if self.tracker is not None else None
        results = run_results(
            self.cfg,
            self.step,
            self.loss,
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

    def agree_on_stop(self, last: bool) -> tuple[bool, bool]:
        """Whether the supervisor asked any rank to stop, and whether a checkpoint still fits before its
        deadline (judged by the last save's duration, start to commit). Every rank casts its vote after each
        step, an all-reduce (MAX) of two numbers in CPU memory that runs while the next step computes, and
        counts the previous step's: every rank gets the same answer at the same step, a step after the
        request, and no step waits for the vote. The last step's vote is counted at once."""
        votes = torch.tensor([self.channel.stop_deadline or 0.0, time.time() + self.saver.last_save_s])
        votes = votes.to(torch.float64)
        cast = (dist.all_reduce(votes, op=dist.ReduceOp.MAX, async_op=True), votes)
        counted, self.vote = (cast, None) if last else (self.vote, cast)
        if counted is None:
            return False, False
        counted[0].wait()
        deadline, ready_by = counted[1].tolist()
        return deadline > 0, ready_by <= deadline

    # -- checkpoints ----------------------------------------------------------------------------

    def say(self, line: str) -> None:
        """A line of this rank's for the user: on its stderr, and up to the driver, which prints rank 0's."""
        checkpoint.say(line)
        self.said.append(line)
        self.channel.report({"said": list(self.said)})

    def checkpoint(self, wait: bool) -> None:
        """Save (in the background with checkpoint.async), telling the supervisor that this rank is saving
        (slow, not hung) while the step waits for it; `wait`: until it has committed. The step's metrics
        line is written first: a run resumed from this checkpoint starts at the next step and would never
        write it."""
        self.log_read()
        self.channel.report({"phase": Phase.CHECKPOINT})
        start = time.perf_counter()
        with self.outside_steps():
            self.check_finite()  # never a checkpoint of NaN weights
            self.save()
            if wait:
                self.saver.wait()
        self.blocked_s += time.perf_counter() - start  # what a background save saves, per save (checkpoint_block_s)
        self.channel.report({"phase": Phase.TRAIN})

    def state(self) -> tuple[dict, dict]:
        return checkpoint_state(self.learner, self.optimizer)

    def save(self) -> None:
        meta = {
            "step": self.step,
            "loss": self.loss,
            "world_size": self.world,
            "layout": self.layout.as_dict(),
            "data": {"seed": self.cfg.trainer.seed, "next_step": self.step + 1},
            "config": self.plain_config,  # what a resume is checked against
            "wandb_run_id": self.tracker.wandb_run_id if self.tracker is not None else None,
        }
        self.saver.save(self.step, self.state()[0], meta, rng_states(self.device))

    def load(self, path: str) -> None:
        """Restore weights, optimizer, step, data position and RNG."""
        if self.cfg.run_url:  # the driver chose it on the store: this node's mirror gets it (or an older one)
            store = self.saver.remote.store
            path = remote.fetch(store, self.run_dir / remote.PREFIX, checkpoint.step_of(Path(path).name))
            if path is None:
                raise DamagedCheckpointError(f"{store.url}/{remote.PREFIX} no longer holds a committed checkpoint")
        state, groups = self.state()
        meta, rank_state = checkpoint.load(path, state)
        self.apply(state, groups)
        self.step, self.loss = meta["step"], meta["loss"]
        if rank_state is not None:
            set_rng_states(rank_state, self.device)

    def apply(self, state: dict, groups: dict) -> None:
        """Set the model and optimizer from `state` (as `state()` made it, then filled) and the hyperparameters."""
        set_state_dict(
            self.learner.module,
            local_optimizer(self.optimizer),
            model_state_dict=state["model"],
            optim_state_dict={**self.learner.parallel.checkpoint_names(state["optim"], saving=False), **groups},
            options=STATE_OPTIONS,
        )

    # -- recovery from live replicas (train/peers.py) ------------------------------------------------

    def held(self) -> peers.Held | None:
        """What this rank keeps in memory when its attempt fails, for the next one to start from: its state,
        if whole (the failure came between optimizer updates) and the layout has replicas to share it; and the
        last logged steps' lines: the one read back last, and one still being read back if its sum has arrived."""
        c, optimizer = self.cfg.cluster, local_optimizer(self.optimizer)
        if self.done is None or not c.peer_recovery or self.layout.dp_replicate < 2 or not optimizer.state:
            return None  # torn, not asked for, no replica, or nothing trained yet (a fresh start loses no step)
        if isinstance(self.optimizer, NVMeAdamW):
            return None  # its state is in scratch files this process no longer owns once it fails
        lines = dict(self.last_read)
        if self.unread is not None and self.unread[0] == self.done and self.unread[2].ready():
            with contextlib.suppress(Exception):
                total, norm = self.unread[2].read()
                lines[self.done] = {"loss": self.mean_of(total), "grad_norm": norm, **self.unread[1]}
        return peers.Held(
            self.job.run_id,
            self.rank,
            self.world,
            self.done,
            {key: peers.local(t) for key, t in peers.flatten(self.state()[0]).items()},
            {"rng": self.rng, "loss": self.loss},
            lines,
        )

    def load_from_peers(self, plan: PeerPlan) -> None:
        """Restore weights, optimizer, step and RNG from this rank's own memory of the failed attempt, or from
        the rank of another replica the plan names; then check that every shard's replicas hold the same bits."""
        state, groups = self.state()
        midway = lambda: self.learner.faults.kill_mid_transfer(plan.number)  # noqa: E731
        extras = peers.fill(peers.flatten(state), plan.sources, self.rank, peers.kept(plan.run, plan.step), midway)
        self.apply(state, groups)
        self.step, self.loss = plan.step, extras["loss"]
        set_rng_states(extras["rng"], self.device)
        peers.check_replicas(peers.flatten(self.state()[0]), self.layout.shard_of(self.rank), plan.step)
