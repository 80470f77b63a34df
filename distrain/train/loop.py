"""One rank of collective training: process group → Learner (model, layout, data shard) → step loop
→ metrics and checkpoints.

`run_rank` is what a worker executes. It knows torch.distributed (through `distrain.parallel`)
and nothing about Ray: it joins the process group from torchrun-style environment variables,
reports progress through the channel it is given, and reads a stop request from it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from distrain import checkpoint
from distrain.channel import Channel, Phase
from distrain.config import ClusterConfig, TrainConfig, from_plain
from distrain.data.loader import run_batches
from distrain.layout import Layout
from distrain.model.size import flops_per_token
from distrain.parallel import process_group
from distrain.tracking import Tracker, run_results
from distrain.train.faults import Faults
from distrain.train.learner import Learner
from distrain.train.metrics import peak_flops, peak_memory_bytes
from distrain.train.optim import build_optimizer, local_optimizer, lr_at, set_lr

STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def run_rank(job: dict, channel: Channel) -> dict:
    """Train this rank's part of the run described by `job` (a plain dict: config, layout, run_dir,
    resume_from, wandb_run_id, started_at, and use_gpu: whether the rank was given a GPU, absent where
    it trains on whatever torch sees); rank 0 returns the run's results, the others an empty dict. The
    results say `stopped` when a stop request ended the run before max_steps."""
    cfg, layout = from_plain(job["config"]), Layout.from_dict(job["layout"])
    channel.report({"phase": Phase.JOIN})
    device = process_group.init_from_env(outside_steps_timeout_s(cfg.cluster), job.get("use_gpu"))
    channel.report({"phase": Phase.SETUP, "joined_at": time.time()})
    try:
        results = Trainer(cfg, layout, job, device, channel).fit()
    except BaseException:
        process_group.abort()  # a graceful destroy would wait for collectives its peers may never join
        raise
    process_group.destroy()
    return results


def outside_steps_timeout_s(c: ClusterConfig) -> float:
    """The collective timeout outside training steps (start-up, checkpoints, evaluation): as long as the
    supervisor lets a rank take there, setup_timeout_s, and no shorter than a step's."""
    return max(c.collective_timeout_s, c.setup_timeout_s)


def warm_up(job: dict) -> None:
    """What a hot spare does while it waits for a rank: this module's imports (torch and the whole
    trainer, loaded as this function arrives), what torch imports on first use (DDP imports dynamo
    as it is built: 1.3 s), and the run's corpus, so that taking over costs none of them."""
    import torch._dynamo  # noqa: F401

    run_batches(from_plain(job["config"]))


class Trainer:
    def __init__(self, cfg: TrainConfig, layout: Layout, job: dict, device: torch.device, channel: Channel):
        self.cfg, self.layout, self.device, self.channel = cfg, layout, device, channel
        self.plain_config, self.run_dir, self.started_at = job["config"], Path(job["run_dir"]), job["started_at"]
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        assert layout.world_size == self.world, f"{layout} does not cover the {self.world} ranks"
        faults = Faults(cfg.fault, self.rank, channel)
        self.learner = Learner(cfg, layout, layout.data_shard(self.rank), device, faults)
        with self.outside_steps():  # the mesh's groups now exist: they get start-up's timeout too
            self.optimizer = build_optimizer(self.learner.module, cfg.optim, self.learner.parallel.zero1_group)
            self.step, self.loss, self.save_s = 0, math.nan, 0.0
            if job["resume_from"]:
                self.load(job["resume_from"])
            self.learner.settle(self.step + 1)
            self.tracker = None
            if self.rank == 0:
                self.tracker = Tracker(str(self.run_dir), job["config"], self.step, job["wandb_run_id"])
        channel.report({"step": self.step, "max_steps": cfg.trainer.max_steps, "loaded_at": time.time()})

    # -- reductions over the ranks ----------------------------------------------------------------

    def global_mean(self, local_sum: torch.Tensor) -> float:
        """Mean over the global batch of per-micro-batch means (equal sizes, so the batch mean).
        Every rank that computes a loss (tensor-parallel peers hold the same one; ranks without
        the last pipeline stage hold none and add zero) is counted once per micro-batch."""
        total = local_sum.detach().clone()
        dist.all_reduce(total)
        return total.item() / (self.layout.micro_batches * self.layout.loss_holders)

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
        process_group.set_timeout(outside_steps_timeout_s(self.cfg.cluster))
        yield
        dist.barrier()
        process_group.set_timeout(self.cfg.cluster.collective_timeout_s)

    # -- the loop -------------------------------------------------------------------------------

    def fit(self) -> dict:
        t = self.cfg.trainer
        tokens_per_step = t.global_batch_size * t.seq_len
        flops_token = flops_per_token(self.cfg.model, t.seq_len)
        peak = peak_flops(self.device, self.learner.precision)
        first_step_s, val_loss, stopped = None, None, False
        window_start, window_steps = time.perf_counter(), 0
        fit_start = time.perf_counter()

        while self.step < t.max_steps:
            self.step += 1
            # Forward and backward over this rank's micro-batches, the gradient all-reduced on the way;
            # the summed micro-batch losses (local) and the norm before clipping; one optimizer step.
            set_lr(self.optimizer, lr_at(self.step, self.cfg.optim, t.max_steps))
            loss_sum = self.learner.forward_backward(self.step)
            grad_norm = self.learner.clip(self.cfg.optim.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            window_steps += 1
            if first_step_s is None:
                first_step_s = time.time() - self.started_at
                self.channel.report({"first_step_at": time.time()})
            last = self.step == t.max_steps
            evaluate_now = (t.eval_interval > 0 and self.step % t.eval_interval == 0) or last
            progress = {"phase": Phase.TRAIN, "step": self.step, "max_steps": t.max_steps}
            if self.step % t.log_interval == 0 or evaluate_now:
                self.loss = self.global_mean(loss_sum)  # waits for the window's steps to finish
                elapsed = time.perf_counter() - window_start
                tokens_per_s = tokens_per_step * window_steps / elapsed
                metrics = {
                    "loss": self.loss,
                    "lr": self.optimizer.param_groups[0]["lr"],
                    "grad_norm": grad_norm.item(),
                    "tokens_per_s": tokens_per_s,
                    "step_time_s": elapsed / window_steps,
                    "peak_memory_bytes": peak_memory_bytes(self.device),
                }
                if peak is not None:
                    metrics["mfu"] = flops_token * tokens_per_s / (peak * self.world)
                if evaluate_now:
                    val_loss = metrics["val_loss"] = self.evaluate()
                if self.tracker is not None:
                    self.tracker.log(self.step, metrics)
                progress.update(metrics)
                window_start, window_steps = time.perf_counter(), 0  # evaluation is not training time
            self.channel.report(progress)
            stopped, save_fits = self.agree_on_stop()
            if (self.cfg.checkpoint.interval and self.step % self.cfg.checkpoint.interval == 0) or last:
                window_start += self.checkpoint()  # saving is not training time either
            elif stopped and save_fits:
                self.checkpoint()
            if stopped:
                break

        wandb_run_id = self.tracker.wandb_run_id if self.tracker is not None else None
        results = run_results(
            self.cfg,
            self.step,
            self.loss,
            val_loss,
            first_step_s,
            time.perf_counter() - fit_start,
            self.world,
            wandb_run_id,
            stopped and self.step < t.max_steps,
        )
        if self.tracker is not None:
            self.tracker.close(results)
        return results if self.rank == 0 else {}

    def agree_on_stop(self) -> tuple[bool, bool]:
        """Whether the supervisor asked any rank to stop, and whether a checkpoint still fits before
        its deadline (judged by the last save's duration). One all-reduce of two numbers in CPU
        memory per step gives every rank the same answer at the same step."""
        votes = torch.tensor([self.channel.stop_deadline or 0.0, time.time() + self.save_s], dtype=torch.float64)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        deadline, ready_by = votes.tolist()
        return deadline > 0, ready_by <= deadline

    # -- checkpoints ----------------------------------------------------------------------------

    def checkpoint(self) -> float:
        """Save, telling the supervisor that this rank is saving (slow, not hung); return the seconds."""
        self.channel.report({"phase": Phase.CHECKPOINT})
        start = time.perf_counter()
        with self.outside_steps():
            self.save()
        self.save_s = time.perf_counter() - start
        self.channel.report({"phase": Phase.TRAIN})
        return self.save_s

    def state(self) -> tuple[dict, dict]:
        """What a checkpoint holds, and the hyperparameters it leaves out. Keyed by full-model parameter
        name, whatever the layout: a checkpoint resumes on any. Optimizer state is flattened to one
        entry per parameter so that ranks holding different parameters (pipeline stages, ZeRO-1
        shards) contribute disjoint keys. Its `param_groups.*` entries (lr, betas, eps, weight decay:
        one small item per parameter and key, most of what a load reads) are not saved: the config
        says them, and the schedule sets lr every step."""
        model_sd, optim_sd = get_state_dict(self.learner.module, local_optimizer(self.optimizer), options=STATE_OPTIONS)
        groups = {k: optim_sd.pop(k) for k in [k for k in optim_sd if k.startswith("param_groups.")]}
        return {"model": model_sd, "optim": optim_sd}, groups

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
        rank_state = {"cpu_rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            rank_state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        checkpoint.save(
            self.run_dir / "checkpoints", self.step, self.state()[0], meta, rank_state, self.cfg.checkpoint.keep
        )

    def load(self, path: str) -> None:
        """Restore weights, optimizer, step, data position and RNG."""
        state, groups = self.state()
        meta, rank_state = checkpoint.load(path, state)
        set_state_dict(
            self.learner.module,
            local_optimizer(self.optimizer),
            model_state_dict=state["model"],
            optim_state_dict={**state["optim"], **groups},
            options=STATE_OPTIONS,
        )
        self.step, self.loss = meta["step"], meta["loss"]
        if rank_state is not None:
            torch.set_rng_state(rank_state["cpu_rng"])
            if "cuda_rng" in rank_state and self.device.type == "cuda":
                torch.cuda.set_rng_state(rank_state["cuda_rng"], self.device)
