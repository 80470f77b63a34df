"""One parameter-server worker: pull the weights, compute a gradient on this worker's slice of
the step's batch, push it to every shard (EASGD: train locally, exchange every τ steps).

Step k of worker w is its slice w of global batch k, the slice data-parallel rank w takes under
DDP: after `max_steps` steps of every worker, every mode has seen the data DDP sees. What a step
measured (loss, gradient norm, staleness, bytes) travels to shard 0 with the worker's next call,
where the driver collects it.
"""

from __future__ import annotations

import math
import os
import time

import ray
import torch
from torch import nn

from distrain.config import TrainConfig, from_plain, resolve_precision
from distrain.data.loader import run_batches
from distrain.layout import micro_batches
from distrain.model.llama import Transformer
from distrain.ps.shard import ShardView, as_tensor, model_shards
from distrain.train.loop import Channel, cross_entropy, straggle
from distrain.train.metrics import peak_memory_bytes
from distrain.train.optim import build_optimizer, lr_at


def run_worker(job: dict, channel: Channel) -> dict:
    """Train this worker's part of a parameter-server run until max_steps or a stop."""
    return PSWorker(from_plain(job["config"]), job, channel).fit()


def evaluate_final(job: dict, channel: Channel) -> dict:
    """The validation loss of the servers' weights (EASGD: the centre) once training has ended."""
    worker = PSWorker(from_plain(job["config"]), job, channel)
    worker.pull(0)
    return {"val_loss": worker.evaluate()}


class PSWorker:
    def __init__(self, cfg: TrainConfig, job: dict, channel: Channel):
        self.cfg, self.channel, self.servers = cfg, channel, job["servers"]
        t, s = cfg.trainer, cfg.strategy
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        self.device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.bf16 = resolve_precision(t.precision, gpu=self.device.type == "cuda") == "bf16"
        torch.manual_seed(t.seed)
        self.model = Transformer(cfg.model, t.seq_len).to(self.device)
        self.views = [ShardView(self.model, pieces) for pieces in model_shards(self.model, s.num_servers)]
        self.versions = [-1] * len(self.servers)  # the version of each shard the model holds
        self.accum_steps = micro_batches(t.global_batch_size, t.micro_batch_size, self.world)
        self.train_batches, self.val_batches = run_batches(cfg)
        self.pulled_bytes = 0
        self.stopped = False

    # -- the model ------------------------------------------------------------------------------

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def forward_backward(self, step: int) -> tuple[float, torch.Tensor]:
        """This worker's slice of batch `step` in accumulation micro-batches; returns the mean loss
        and the gradient's norm (unclipped)."""
        start = time.perf_counter()
        x, y = (t.to(self.device) for t in self.train_batches.get(step, self.rank, self.world))
        self.model.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)  # summed as the trainer sums: the same last bits
        with self.autocast():
            for xm, ym in zip(x.chunk(self.accum_steps), y.chunk(self.accum_steps), strict=True):
                loss = cross_entropy(self.model(xm), ym)
                (loss / self.accum_steps).backward()
                total += loss.detach()
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        straggle(self.cfg.trainer, self.rank, time.perf_counter() - start)
        return total.item() / self.accum_steps, norm

    def clip(self, norm: torch.Tensor) -> None:
        """What the trainer does to a gradient that is applied on its own (async, Hogwild, EASGD)."""
        if self.cfg.optim.grad_clip > 0:
            params = [p for p in self.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.optim.grad_clip, norm)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.channel.report({"phase": "eval"})
        self.model.eval()
        total = 0.0
        with self.autocast():
            for i in range(self.cfg.trainer.eval_batches):
                x, y = (t.to(self.device) for t in self.val_batches.get(i))
                total += cross_entropy(self.model(x), y).item()
        self.model.train()
        self.channel.report({"phase": "train"})
        return total / self.cfg.trainer.eval_batches

    # -- talking to the servers -----------------------------------------------------------------

    def pull(self, min_version: int, apply: tuple[int, float] | None = None) -> int:
        """Load every shard's weights of at least `min_version` into the model (a shard whose
        version the model already holds is not fetched again); returns the lowest version."""
        self.channel.report({"phase": "wait"})
        answers = ray.get([s.pull.remote(self.rank, min_version, apply) for s in self.servers])
        fresh = [(k, v, refs[0]) for k, (v, refs, _) in enumerate(answers) if v != self.versions[k]]
        for (k, v, _), flat in zip(fresh, ray.get([ref for _, _, ref in fresh]), strict=True):
            self.views[k].scatter(as_tensor(flat))
            self.versions[k] = v
            self.pulled_bytes += flat.nbytes
        self.stopped = self.stopped or any(stopped for _, _, stopped in answers)
        self.channel.report({"phase": "train"})
        return min(v for v, _, _ in answers)

    def call_all(self, method: str, step: int, payloads: list, records: list[dict]) -> list[dict]:
        """One call per shard with its payload; shard 0 also gets the pending records."""
        self.channel.report({"phase": "wait"})
        refs = [
            getattr(s, method).remote(self.rank, step, p, records if k == 0 else [])
            for k, (s, p) in enumerate(zip(self.servers, payloads, strict=True))
        ]
        answers = ray.get(refs)
        self.stopped = self.stopped or any(a["stopped"] for a in answers)
        self.channel.report({"phase": "train"})
        return answers

    # -- the loop -------------------------------------------------------------------------------

    def fit(self) -> dict:
        start = min(ray.get([s.next_step.remote(self.rank) for s in self.servers]))
        self.servers[0].log.remote([{"worker": self.rank, "start": start}])  # lines need not wait for steps it skips
        step = self.easgd(start) if self.cfg.strategy.mode == "easgd" else self.gradients(start)
        return {"final_step": step, "stopped": self.stopped}

    def gradients(self, step: int) -> int:
        """sync, async, Hogwild: a gradient per step, pushed to every shard."""
        t, sync = self.cfg.trainer, self.cfg.strategy.mode == "sync"
        pending: list[dict] = []
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
            self.evaluate_into(pending)
            self.channel.report({"step": step, "max_steps": t.max_steps})
            loss, norm = self.forward_backward(step)
            if not sync:
                self.clip(norm)
            grads = [view.gather(grad=True).numpy() for view in self.views]
            record = self.record(step, loss, norm, pushed=sum(g.nbytes for g in grads))
            answers = self.call_all("push", step, grads, pending)
            pending = [record]
            if sync:
                norms = [a["norm_sq"] for a in answers]
                apply = (step, math.sqrt(sum(norms))) if None not in norms else None
                record["grad_norm"] = apply[1] if apply else record["grad_norm"]  # the averaged gradient's
            record["applied"] = all(a["applied"] for a in answers)
            stale = [a["staleness"] for a in answers if "staleness" in a]
            record["staleness"] = max(stale) if stale else None
            done = step
            if self.stopped:
                break
            step += 1
        if apply is not None and not self.stopped:
            self.pull(apply[0], apply)  # the last round is applied by the next pull: there is none
        ray.get(self.servers[0].log.remote(pending))
        return done

    def easgd(self, step: int) -> int:
        """Local steps on this worker's own weights, the elastic exchange every τ of them."""
        t, tau, interval = self.cfg.trainer, self.cfg.strategy.tau, self.cfg.trainer.eval_interval
        self.pull(0)  # a worker (re)starts from the centre
        optimizer = build_optimizer(self.model, self.cfg.optim)
        pending: list[dict] = []
        done = step - 1
        while step <= t.max_steps and not self.stopped:
            self.channel.report({"phase": "train", "step": step, "max_steps": t.max_steps})
            loss, norm = self.forward_backward(step)
            self.clip(norm)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, self.cfg.optim, t.max_steps)
            optimizer.step()
            pending.append(record := self.record(step, loss, norm, pushed=0))
            if step % tau == 0 or step == t.max_steps:
                weights = [view.gather(grad=False).numpy() for view in self.views]
                record["bytes_pushed"] = sum(w.nbytes for w in weights)
                answers = self.call_all("exchange", step, weights, [])
                for view, answer in zip(self.views, answers, strict=True):
                    if answer["diff"] is not None:
                        view.scatter(view.gather(grad=False) - as_tensor(answer["diff"]))
                        self.pulled_bytes += answer["diff"].nbytes
            if self.rank == 0 and interval and step % interval == 0 and step < t.max_steps:
                record["val_loss"] = self.evaluate_centre()
            if step % tau == 0 or "val_loss" in record:
                self.servers[0].log.remote(pending)
                pending = []
            done = step
            step += 1
        ray.get(self.servers[0].log.remote(pending))
        return done

    def evaluate_centre(self) -> float:
        local = nn.utils.parameters_to_vector(self.model.parameters()).clone()
        self.versions = [-1] * len(self.servers)
        self.pull(0)
        val_loss = self.evaluate()
        nn.utils.vector_to_parameters(local, self.model.parameters())
        return val_loss

    def evaluate_into(self, pending: list[dict]) -> None:
        """Worker 0, at the start of the step after an evaluation step: the validation loss of the
        weights that step produced, into that step's record (still unsent)."""
        interval = self.cfg.trainer.eval_interval
        if self.rank == 0 and pending and interval and pending[-1]["step"] % interval == 0:
            pending[-1]["val_loss"] = self.evaluate()

    def record(self, step: int, loss: float, norm: torch.Tensor, pushed: int) -> dict:
        record = {
            "worker": self.rank,
            "step": step,
            "loss": loss,
            "grad_norm": norm.item(),
            "bytes_pushed": pushed,
            "bytes_pulled": self.pulled_bytes,
            "time": time.time(),
            "peak_memory_bytes": peak_memory_bytes(self.device),
        }
        self.pulled_bytes = 0
        return record
