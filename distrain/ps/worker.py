"""One parameter-server worker: pull the weights, compute a gradient on this worker's slice of
the step's batch, push it to every shard (EASGD: train locally, exchange every τ steps).

The step itself is the trainer's (train/learner.py: the same model, data slice, micro-batches,
autocast and clipping); only where the gradient goes differs. Step k of worker w is its slice w of
global batch k, the slice data-parallel rank w takes under DDP: after `max_steps` steps of every
worker, every mode has seen the data DDP sees. A step's record (loss, gradient norm, bytes, time)
travels to shard 0 with the push of that step, where the driver collects it.
"""

from __future__ import annotations

import math
import os
import time

import ray
import torch
from torch import nn

from distrain.channel import Channel, Phase
from distrain.config import TrainConfig
from distrain.data.loader import run_batches
from distrain.ps.job import WorkerJob
from distrain.ps.shard import ShardView, as_tensor, model_shards
from distrain.strategy import resolve
from distrain.train.faults import Faults
from distrain.train.learner import Learner, local_device
from distrain.train.metrics import memory_peaks
from distrain.train.optim import build_optimizer, lr_at, set_lr


def run_worker(job: WorkerJob, channel: Channel) -> dict:
    """Train this worker's part of a parameter-server run until max_steps or a stop."""
    return PSWorker(job, channel).fit()


def evaluate_final(job: WorkerJob, channel: Channel) -> dict:
    """The validation loss of the servers' weights (EASGD: the centre) once training has ended."""
    worker = PSWorker(job, channel)
    worker.pull(0)
    return {"val_loss": worker.evaluate()}


def warm_up(cfg: TrainConfig) -> None:
    """A hot spare's wait: this module's imports (torch, the learner) and the run's corpus."""
    run_batches(cfg)


class PSWorker:
    def __init__(self, job: WorkerJob, channel: Channel):
        cfg, layout = job.config, job.layout
        self.cfg, self.channel, self.servers = cfg, channel, job.servers
        self.rank = int(os.environ["RANK"])
        faults = Faults(cfg.fault, self.rank, channel)
        # The whole model in this process (no process group), this worker's data-parallel slice.
        single = resolve.single(layout.micro_batches)
        device = local_device(job.use_gpu)  # None: whatever torch sees, as under torchrun
        self.learner = Learner(cfg, single, layout.data_shard(self.rank), device, faults, collective=False)
        self.model = self.learner.module
        self.views = [ShardView(self.model, pieces) for pieces in model_shards(self.model, cfg.ps.num_servers)]
        self.versions = [-1] * len(self.servers)  # the version of each shard the model holds
        self.pulled_bytes = 0
        self.stopped = False

    # -- the model ------------------------------------------------------------------------------

    def step(self, step: int, clip: bool) -> tuple[float, torch.Tensor]:
        """The trainer's forward and backward on this worker's slice of batch `step`; the mean loss
        and the gradient's norm (clipped as the trainer clips when `clip`: a gradient applied alone)."""
        self.model.zero_grad(set_to_none=True)
        loss_sum = self.learner.forward_backward(step)
        norm = self.learner.parallel.clip_grad_norm(self.cfg.optim.grad_clip if clip else 0.0)
        return loss_sum.item() / self.learner.parallel.layout.micro_batches, norm

    def evaluate(self) -> float:
        """The validation loss of the weights the model holds, over whole validation batches."""
        self.channel.report(phase=Phase.EVAL)
        loss_sum = self.learner.evaluate(shard=(0, 1))
        self.channel.report(phase=Phase.TRAIN)
        return loss_sum.item() / (self.learner.parallel.layout.micro_batches * self.cfg.trainer.eval_batches)

    def validate_after(self, step: int, centre: bool = False) -> None:
        """Worker 0, after an evaluation step: the validation loss of the weights it produced (EASGD:
        the centre's), to shard 0 at once, before this worker's next record."""
        t = self.cfg.trainer
        if self.rank != 0 or not t.eval_interval or step % t.eval_interval or not 0 < step < t.max_steps:
            return
        local = nn.utils.parameters_to_vector(self.model.parameters()).clone() if centre else None
        if centre:
            self.versions = [-1] * len(self.servers)
            self.pull(0)
        val_loss = self.evaluate()
        if local is not None:
            nn.utils.vector_to_parameters(local, self.model.parameters())
        ray.get(self.servers[0].log.remote([{"worker": 0, "step": step, "val_loss": val_loss}]))

    def record(self, step: int, loss: float, norm: torch.Tensor, pushed: int) -> dict:
        record = {
            "worker": self.rank,
            "step": step,
            "loss": loss,
            "grad_norm": norm.item(),
            "bytes_pushed": pushed,
            "bytes_pulled": self.pulled_bytes,
            "time": time.time(),
            **memory_peaks(self.learner.device),
        }
        self.pulled_bytes = 0
        return record

    # -- talking to the servers -----------------------------------------------------------------

    def pull(self, min_version: int, apply: tuple[int, float] | None = None) -> int:
        """Load every shard's weights of at least `min_version` into the model (a shard whose
        version the model already holds is not fetched again); returns the lowest version."""
        self.channel.report(phase=Phase.WAIT)
        answers = ray.get([s.pull.remote(self.rank, min_version, apply) for s in self.servers])
        fresh = [(k, v, refs[0]) for k, (v, refs, _) in enumerate(answers) if v != self.versions[k]]
        for (k, v, _), flat in zip(fresh, ray.get([ref for _, _, ref in fresh]), strict=True):
            self.views[k].scatter(as_tensor(flat))
            self.versions[k] = v
            self.pulled_bytes += flat.nbytes
        self.stopped = self.stopped or any(stopped for _, _, stopped in answers)
        self.channel.report(phase=Phase.TRAIN)
        return min(v for v, _, _ in answers)

    def call_all(self, method: str, step: int, payloads: list, to_first: object) -> list[dict]:
        """One call per shard with its payload; shard 0 also gets `to_first` (the step's records)."""
        self.channel.report(phase=Phase.WAIT)
        refs = [
            getattr(s, method).remote(self.rank, step, p, to_first if k == 0 else None)
            for k, (s, p) in enumerate(zip(self.servers, payloads, strict=True))
        ]
        answers = ray.get(refs)
        self.stopped = self.stopped or any(a["stopped"] for a in answers)
        self.channel.report(phase=Phase.TRAIN)
        return answers

    def exchange(self, step: int, records: list[dict]) -> None:
        """EASGD's elastic exchange after local step `step` (`records`: those of the local steps since
        the last exchange, the newest last): every shard moves its centre towards this worker's weights
        and returns the difference d, which this worker subtracts from its own weights."""
        weights = [view.gather(grad=False).numpy() for view in self.views]
        if records:
            records[-1]["bytes_pushed"] = sum(w.nbytes for w in weights)
        answers = self.call_all("exchange", step, weights, records)
        for view, answer in zip(self.views, answers, strict=True):
            if answer["diff"] is not None:
                view.scatter(view.gather(grad=False) - as_tensor(answer["diff"]))
                self.pulled_bytes += answer["diff"].nbytes

    # -- the loop -------------------------------------------------------------------------------

    def fit(self) -> dict:
        start = min(ray.get([s.next_step.remote(self.rank) for s in self.servers]))
        self.servers[0].log.remote([{"worker": self.rank, "start": start}])  # lines need not wait for steps it skips
        step = self.easgd(start) if self.cfg.ps.mode == "easgd" else self.gradients(start)
        return {"final_step": step, "stopped": self.stopped}

    def gradients(self, step: int) -> int:
        """sync, async, Hogwild: a gradient per step, pushed to every shard."""
        t, sync = self.cfg.trainer, self.cfg.ps.mode == "sync"
        apply = None
        done = step - 1
        while step <= t.max_steps:
            version = self.pull(step - 1 if sync else 0, apply)
            if self.stopped:
                break
            if sync:
                step = max(step, version + 1)  # a dropped straggler skips the rounds that closed without it
                if step > t.max_steps:
                    break
            self.validate_after(step - 1)
            self.channel.report(step=step, max_steps=t.max_steps)
            loss, norm = self.step(step, clip=not sync)  # sync: clipped on the servers, by the average's norm
            grads = [view.gather(grad=True).numpy() for view in self.views]
            record = self.record(step, loss, norm, pushed=sum(g.nbytes for g in grads))
            answers = self.call_all("push", step, grads, record)
            if sync:
                norms = [a["norm_sq"] for a in answers]
                apply = (step, math.sqrt(sum(norms))) if None not in norms else None
            done = step
            if self.stopped:
                break
            step += 1
        if apply is not None and not self.stopped:
            self.pull(apply[0], apply)  # the last round is applied by the next pull: there is none
        return done

    def easgd(self, step: int) -> int:
        """Local steps on this worker's own weights, the elastic exchange every τ of them."""
        t, tau = self.cfg.trainer, self.cfg.ps.tau
        self.pull(0)  # a worker (re)starts from the centre
        optimizer = build_optimizer(self.model, self.cfg.optim)
        pending: list[dict] = []
        done = step - 1
        while step <= t.max_steps and not self.stopped and self.channel.stop_deadline is None:
            self.channel.report(phase=Phase.TRAIN, step=step, max_steps=t.max_steps)
            set_lr(optimizer, lr_at(step, self.cfg.optim, t.max_steps))
            loss, norm = self.step(step, clip=True)
            optimizer.step()
            pending.append(self.record(step, loss, norm, pushed=0))
            if step % tau == 0 or step == t.max_steps:
                self.exchange(step, pending)
                pending = []
            self.validate_after(step, centre=True)
            done = step
            step += 1
        ray.get(self.servers[0].log.remote(pending))  # local steps since the last exchange, if stopped
        return done
