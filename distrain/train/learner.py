"""One rank's model, data and step arithmetic: the path the trainer and the parameter-server worker share.

A Learner builds the model on the rank's device, lays it out for its layout (`ParallelModel`, whose
`clip_grad_norm` its users call), and runs a step's micro-batches forward and backward under autocast,
and evaluation. Where the gradient is synchronised is the one difference between its users: under
collective training the data-parallel wrapper all-reduces it during the last micro-batch's backward;
a parameter-server worker's model has no wrapper (`collective=False`), and the worker pushes the
rank-local gradient to the servers itself.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from distrain.config import TrainConfig, resolve_precision
from distrain.data.loader import Batches, Prefetch, run_batches
from distrain.model.contract import fill_parameters
from distrain.model.hf import hf_weights
from distrain.model.lora import add_adapters, is_adapter
from distrain.model.registry import build_model
from distrain.parallel import process_group
from distrain.parallel.parallelize import ParallelModel
from distrain.strategy.layout import Layout
from distrain.train.faults import Faults


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def local_device(gpu: bool | None = None) -> torch.device:
    """The device of a rank without a process group (a parameter-server worker), chosen as a collective rank's
    is (`process_group.device_for`): its GPU when the cluster gave it one (`gpu`), failing in one line if
    torch cannot use it, never falling back to the CPU in silence."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = process_group.device_for(gpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class Learner:
    def __init__(
        self,
        cfg: TrainConfig,
        layout: Layout,
        shard: tuple[int, int],
        device: torch.device,
        faults: Faults,
        collective: bool = True,
    ):
        """`layout` is how the model is laid out over the process group (a single process when not
        `collective`); `shard` is (index, count): the rank's slice of every global batch."""
        self.cfg, self.device, self.shard, self.faults = cfg, device, shard, faults
        self.precision = resolve_precision(cfg.trainer.precision, gpu=device.type == "cuda")
        s = cfg.strategy
        # Built on the meta device, materialised by ParallelModel once laid out: a rank allocates only
        # its shards, and their values are the same in every layout and engine (distrain/model/contract.py).
        with torch.device("meta"):
            model = build_model(cfg.model, cfg.trainer.seq_len, seed=cfg.trainer.seed)
            add_adapters(model, cfg.finetune.lora, cfg.trainer.seed)  # finetune.lora: the base frozen
        # full-model names of the parameters nothing trains (a LoRA run's base), which checkpoints leave out
        self.frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        bf16, chunk, float8 = self.precision == "bf16", cfg.trainer.loss_chunk, cfg.trainer.float8
        self.parallel = ParallelModel(
            model, s, layout, device, bf16, cross_entropy, collective, loss_chunk=chunk, float8=float8
        )
        if cfg.model.init_from:  # a Hugging Face model's weights, each rank its pieces; a resumed checkpoint wins
            fill_parameters(self.module, hf_weights(cfg.model.init_from, cfg.model), only=lambda n: not is_adapter(n))
        self.train_batches, self.val_batches = run_batches(cfg)
        self.inputs = Prefetch(self.train_batches, shard, device)

    @property
    def module(self) -> nn.Module:
        """What the optimizer steps and checkpoints hold."""
        return self.parallel.module

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")

    def batch(self, batches: Batches, index: int, shard: tuple[int, int] | None = None) -> tuple:
        x, y = batches.get(index, *(shard or self.shard))
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def forward_backward(self, step: int) -> torch.Tensor:
        """This rank's slice of global batch `step`, forward and backward over its micro-batches;
        the gradient of their mean is left in the parameters' `.grad`. Returns the summed
        micro-batch losses (local, unreduced)."""
        self.faults.hold()
        start = time.perf_counter()
        with self.autocast():
            loss_sum = self.parallel.forward_backward(*self.inputs.get(step))
        self.faults.straggle(time.perf_counter() - start)
        return loss_sum

    @torch.no_grad()
    def evaluate(self, shard: tuple[int, int] | None = None) -> torch.Tensor:
        """Summed losses of the micro-batches of trainer.eval_batches validation batches (this
        rank's slice of each, or `shard`'s), local and unreduced."""
        for part in self.parallel.parts:
            part.eval()
        loss_sum = torch.zeros((), device=self.device)
        with self.autocast():
            for i in range(self.cfg.trainer.eval_batches):
                loss_sum += self.parallel.forward_backward(*self.batch(self.val_batches, i, shard), train=False)
        for part in self.parallel.parts:
            part.train()
        return loss_sum

    def settle(self, step: int) -> None:
        """Before the first step of an attempt (ParallelModel.settle_buckets). Its throwaway forward leaves the
        random number generators as it found them: a model that draws (dropout) draws as a run that never stopped."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), self.autocast():
            self.parallel.settle_buckets(*self.batch(self.train_batches, step))
