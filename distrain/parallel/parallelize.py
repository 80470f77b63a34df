"""Compose the parallelisms on one mesh, always in the same order:

    pipeline split → float8 → context parallel → tensor parallel → expert parallel → activation checkpointing
    → compile → data parallel

The pipeline cuts the model into this rank's stages; every other parallelism is a pass (`PASSES`)
applied to each of them in turn, as torchtitan's parallelize_llama applies them. A model built on the
meta device is materialised inside the last pass (data_parallel.materialize), so no rank ever holds the
whole model unless its layout says it must.

The trainer sees only `ParallelModel`: one step's forward and backward, evaluation, gradient
clipping across stages, and the module whose parameters the optimizer and checkpoints hold.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from distrain.compat import settle_gradients
from distrain.config import StrategyConfig
from distrain.model.moe import aux_loss_scale, recomputing
from distrain.parallel import context_parallel, data_parallel, expert_parallel, float8, tensor_parallel
from distrain.parallel.chunked_loss import chunked
from distrain.parallel.data_parallel import no_gradient_sync
from distrain.parallel.mesh import ParallelMesh
from distrain.parallel.passes import Pass, PassContext
from distrain.parallel.routing import Routers
from distrain.parallel.tensor_parallel import loss_context
from distrain.parallel.tpnd.grad_sync import GradSync
from distrain.parallel.tpnd.layers import grid_cross_entropy
from distrain.strategy.layout import Layout

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def apply_activation_checkpointing(model: nn.Module, on: PassContext) -> nn.Module:
    """Keep only each block's input; recompute the rest during the backward pass, where a MoE layer knows it is
    (`recomputing`: it counts its figures once)."""
    if on.cfg.activation_checkpoint:
        for block in model.layers.values():
            checkpoint(block, context_fn=lambda: (contextlib.nullcontext(), recomputing()))
    return model


def apply_compile(model: nn.Module, on: PassContext) -> nn.Module:
    """Compile block by block: the blocks are identical, so one graph serves them all."""
    if on.cfg.compile:
        for block in model.layers.values():
            block.compile(fullgraph=True)
    return model


# What is applied to each part of the model (the whole of it, or each pipeline stage), in this order; a
# parallelism's pass is keyed by its name in distrain.strategy (the pipeline is no pass: it makes the
# parts). A pass that does not apply to the layout returns the part as it is. Float8 comes first, as torchtitan
# converts: the parallelisms then lay out and shard the converted modules.
PASSES: dict[str, Pass] = {
    "float8": float8.parallelize,
    "cp": context_parallel.parallelize,
    "tp": tensor_parallel.parallelize,
    "ep": expert_parallel.parallelize,
    "activation_checkpoint": apply_activation_checkpointing,
    "compile": apply_compile,
    "dp": data_parallel.parallelize,
}


def as_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: the full value of a DTensor (a loss or norm reduced over tensor-parallel peers)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def stage_union(parts: list[nn.Module]) -> nn.Module:
    """One module holding every parameter of this rank's stages under its full-model name: what
    the optimizer steps and what checkpoints save (the stages themselves are only run)."""
    union = nn.Module()
    union.layers = nn.ModuleDict()
    for part in parts:
        union.layers.update(part.layers)
        for name in (*part.input_modules, *part.output_modules):
            if getattr(part, name) is not None:
                setattr(union, name, getattr(part, name))
    return union


class TiedAcrossStages:
    """Parameters tied across pipeline stages held by different ranks (a GPT-2 head on the last
    stage, its embedding on the first): each rank keeps a copy; after the backward their gradients
    are summed over the pipeline group, as the one parameter's would be (Megatron's embedding group),
    so the copies stay equal. The gradient norm counts the alias's copy once, by leaving it out."""

    def __init__(self, module: nn.Module, pairs: tuple[tuple[str, str], ...], pp_group: dist.ProcessGroup):
        self.group = pp_group
        named = dict(module.named_parameters())
        self.pairs = [[named[n] for n in pair if n in named] for pair in pairs]
        self.aliases = {id(named[alias]) for alias, _ in pairs if alias in named}
        self.shapes: list[torch.Size] | None = None

    def _local(self, p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if isinstance(p, DTensor) else p

    def sum_gradients(self, device: torch.device) -> None:
        if self.shapes is None:  # the local piece's shape, known on the ranks holding one: agree once
            self.shapes = [self._agree_shape(held, device) for held in self.pairs]
        for held, shape in zip(self.pairs, self.shapes, strict=True):
            total = torch.zeros(shape, device=device)
            for p in held:
                total += self._local(p.grad)
            dist.all_reduce(total, group=self.group)
            for p in held:
                self._local(p.grad).copy_(total)

    def _agree_shape(self, held: list[nn.Parameter], device: torch.device) -> torch.Size:
        dims = torch.zeros(8, dtype=torch.long, device=device)
        if held:
            shape = self._local(held[0]).shape
            dims[0], dims[1 : 1 + len(shape)] = len(shape), torch.tensor(shape)
        dist.all_reduce(dims, op=dist.ReduceOp.MAX, group=self.group)
        return torch.Size(dims[1 : 1 + int(dims[0])].tolist())

    def counted(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        return [p for p in params if id(p) not in self.aliases]


def rename_tied(state: dict, names: dict[str, str]) -> dict:
    """Flattened optimizer state (`state.<fqn>.<key>`) with each fqn in `names` renamed: a stage's copy
    of a tied parameter is checkpointed under its source's name, which a layout holding the one tensor
    saves it under, so the checkpoint loads in either."""
    prefixes = {f"state.{a}.": f"state.{b}." for a, b in names.items()}
    renamed = {}
    for key, value in state.items():
        old = next((p for p in prefixes if key.startswith(p)), None)
        renamed[prefixes[old] + key[len(old) :] if old else key] = value
    return renamed


class ParallelModel:
    """One rank's share of the model under a strategy: its stages, wrapped, and how to step them.

    `collective=False` builds it for one process without a process group (a parameter-server
    worker, whose gradients travel to the servers instead): no mesh, no wrapper. `loss_chunk` > 0: the
    head and loss over that many tokens at a time (trainer.loss_chunk).
    `float8`: trainer.float8."""

    def __init__(
        self,
        model: nn.Module,
        cfg: StrategyConfig,
        layout: Layout,
        device: torch.device,
        bf16: bool,
        loss_fn: LossFn,
        collective: bool = True,
        *,
        loss_chunk: int = 0,
        float8: str = "none",
    ):
        self.cfg, self.layout, self.device, self.bf16 = cfg, layout, device, bf16
        self.mesh = ParallelMesh(layout, device.type, sharded=cfg.zero >= 2, collective=collective)
        self.vocab_sharded_loss = layout.tp > 1 and layout.tp_mode == "1d" and cfg.loss_parallel

        parts, tied = {0: model}, getattr(model, "tied_parameters", ())  # plain DDP needs no contract
        self.routers = Routers(model, self.mesh, device)  # mixture-of-experts layers, if any
        if layout.pp > 1:
            from distrain.parallel.pipeline import split_stages  # torch's pipelining imports dynamo: only when used

            parts = split_stages(model, self.mesh.get("pp"), layout)
        on = PassContext(cfg, self.mesh, device, bf16, self.vocab_sharded_loss, float8)
        for apply in PASSES.values():  # each pass on every part before the next pass
            parts = {index: apply(part, on) for index, part in parts.items()}
        self.grid, self.grad_sync = on.grid, None  # 2-D, 2.5-D, 3-D tensor parallelism
        self.sequence_split = on.sequence_split  # context parallelism: this rank's tokens of each sequence
        self.experts = on.experts  # expert parallelism: the experts' gradients, summed apart
        self.loss_fn = loss_fn if self.grid is None else functools.partial(grid_cross_entropy, self.grid)
        if loss_chunk:  # the head applied by the loss, a slice of the sequence at a time (chunked_loss.py)
            self.loss_fn = chunked(list(parts.values()), self.loss_fn, loss_chunk)

        self.pipeline = None
        if layout.pp > 1:
            from distrain.parallel.pipeline import Pipeline

            self.pipeline = Pipeline(parts, self.mesh.get("pp"), device, layout, self.loss_fn)
        self.parts = list(parts.values())
        self.module = self.parts[0] if len(self.parts) == 1 else stage_union(self.parts)
        self.routers.hold(self.parts)
        self.step_figures: torch.Tensor | None = None  # theirs over the last training step (Routers.end)
        self.tied = TiedAcrossStages(self.module, tied, self.mesh.group("pp")) if tied and self.pipeline else None
        held = {name for name, _ in self.module.named_parameters()}
        self.copies = {a: b for a, b in tied if a in held and b not in held}  # tied copies on this stage
        if self.grid is not None:
            gradient = self.mesh.gradient
            self.grad_sync = GradSync(self.module, self.grid, gradient.get_group() if gradient else None)

    def checkpoint_names(self, optim_state: dict, saving: bool) -> dict:
        """Flattened optimizer state keyed as checkpoints key it (`saving`) or as this rank's optimizer does."""
        return rename_tied(optim_state, self.copies if saving else {b: a for a, b in self.copies.items()})

    @property
    def zero1_group(self) -> dist.ProcessGroup | None:
        """The group that shards the optimizer state under ZeRO-1, else None."""
        gradient = self.mesh.gradient
        return gradient.get_group() if self.cfg.zero == 1 and gradient is not None else None

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """For a non-final micro-batch: keep its gradient local (no collective) until the last one.
        (The grid layouts' gradient sync runs once, after the last, in any case.)"""
        if last or self.mesh.gradient is None or self.grad_sync is not None:
            return contextlib.nullcontext()
        return no_gradient_sync(self.module)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, train: bool = True) -> torch.Tensor:
        """This rank's batch through the model in the layout's equal micro-batches; gradients (mean
        over the micro-batches) reduced once, after the last. Returns the summed losses (under context
        parallelism each the mean over this rank's share of the tokens)."""
        x, y = self.local_tokens(x, y)
        if train:
            self.routers.begin()
        with loss_context(self.vocab_sharded_loss):
            if self.pipeline is not None:  # its schedule scales every gradient by 1 / micro-batches itself
                losses = [as_tensor(loss.detach()) for loss in self.pipeline.step(x, y, train)]
                if train and self.tied is not None:
                    self.tied.sum_gradients(self.device)
                self.sync_gradients(train)
                return torch.stack(losses).sum() if losses else torch.zeros((), device=x.device)
            n = self.layout.micro_batches
            micro = list(zip(x.chunk(n), y.chunk(n), strict=True))
            total = torch.zeros((), device=x.device)
            for i, (xm, ym) in enumerate(micro):
                with self.no_sync(i == len(micro) - 1) if train else torch.no_grad(), aux_loss_scale(1 / len(micro)):
                    loss = self.loss_fn(self.module(xm), ym)
                    if train:
                        (loss / len(micro)).backward()
                total += as_tensor(loss.detach())
            self.sync_gradients(train)
            return total

    def local_tokens(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens of each sequence, and their targets: all of them, or its context-parallel share."""
        if self.sequence_split is None:
            return x, y
        return self.sequence_split.split(x), self.sequence_split.split(y)

    def sync_gradients(self, train: bool) -> None:
        """The grid layouts reduce gradients here, once per step, and expert parallelism its experts'; the other
        wrappers did during the backward. The mixture-of-experts layers' step ends here too (Routers.end)."""
        if train and self.grad_sync is not None:
            self.grad_sync()
        if train and self.experts is not None:
            self.experts()
        if train:
            self.step_figures = self.routers.end()

    def settle_buckets(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """DDP reduces its first backward's gradients in a bucket laid out in reverse parameter
        order and every later one in buckets rebuilt from the order gradients arrived in. With 3+
        ranks another layout sums each element in another order (gloo's ring starts each chunk at
        a different rank), so the first step after a restart would differ in the last bits from
        the same step in a run that never stopped. One backward before the first step, gradients
        thrown away, gives every step of every run the rebuilt layout. The layout follows the order
        gradients arrive in, not their values, so two tokens of one sequence do (a restart waits
        for this backward, and a whole micro-batch's would cost a step).

        A pipeline's schedule infers its stages' shapes with a forward and backward of its own at its first
        step; run here for a model with experts, they stay out of the step's counts (their tokens per expert).
        (A dense model's pipeline counts nothing: its start is spared a step.)"""
        if self.pipeline is not None and self.routers.blocks:
            with loss_context(self.vocab_sharded_loss):
                self.pipeline.step(x, y)
            for part in self.parts:
                part.zero_grad(set_to_none=True)
        elif isinstance(self.module, DistributedDataParallel):
            # under context parallelism a whole sequence: its ranks' attention meets only over all of it
            x, y = self.local_tokens(x[:1], y[:1]) if self.sequence_split is not None else (x[:1, :2], y[:1, :2])
            self.loss_fn(self.module(x), y).backward()
            self.module.zero_grad(set_to_none=True)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The norm of the whole model's gradient, over shards, tensor-parallel peers and stages;
        scale the gradient down to max_norm when it is positive and the norm exceeds it."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        settle_gradients(params)
        experts = {id(p) for p in self.experts.params()} if self.experts is not None else set()
        groups = [[p for p in params if id(p) not in experts], [p for p in params if id(p) in experts]]
        grads = [p.grad for p in (self.tied.counted(groups[0]) if self.tied is not None else groups[0])]
        norm = self.grid.total_norm(grads) if self.grid is not None else as_tensor(torch.nn.utils.get_total_norm(grads))
        if groups[1]:  # expert parallelism's experts, DTensors on a mesh of their own: their norm taken apart
            expert_norm = as_tensor(torch.nn.utils.get_total_norm([p.grad for p in groups[1]]))
            norm = torch.linalg.vector_norm(torch.stack([norm, expert_norm]))
        if self.pipeline is not None:
            norm = norm.pow(2)
            dist.all_reduce(norm, group=self.mesh.group("pp"))
            norm = norm.sqrt()
        if max_norm > 0:
            for group in groups:
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return norm
