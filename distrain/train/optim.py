"""Optimizers (AdamW, SGD, Muon beside AdamW) and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from distrain.config import OptimConfig
from distrain.train.muon import Muon
from distrain.train.nvme import NVMeAdamW, Scratch


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, zero_group: dist.ProcessGroup | None = None, scratch: Scratch | None = None
) -> torch.optim.Optimizer | Optimizers:
    """Weight decay on matrices only: norms' gains are not decayed (as in GPT-2 and Llama).
    With `zero_group` (ZeRO-1), each rank of the group holds the state of its share of the parameters (the
    experts' under expert parallelism whole: `Optimizers`); with `scratch` (NVMe offload), AdamW's moments live
    in files there. Under optim=muon, Muon steps the matrices `muon_takes` and AdamW the rest."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    orthogonal = [p for n, p in named if cfg.name == "muon" and muon_takes(n, p, cfg.muon_params)]
    taken = {id(p) for p in orthogonal}
    rest = [p for _, p in named if id(p) not in taken]
    decayed, undecayed = [p for p in rest if p.ndim >= 2], [p for p in rest if p.ndim < 2]
    others = make_optimizer(decayed, undecayed, cfg, zero_group, scratch)
    if not orthogonal:
        return others
    options = {"lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay, "ns_steps": cfg.ns_steps}
    groups = [{"params": part} for part in by_mesh(orthogonal)]
    return Optimizers(*sharded(groups, Muon, options, zero_group), *parts(others))


def muon_takes(name: str, p: torch.Tensor, which: str) -> bool:
    """Whether Muon steps parameter `name`: a matrix, inside the blocks (`layers`, whatever wraps them) unless
    optim.muon_params=matrices, which gives it the embeddings and the head too."""
    return p.ndim == 2 and (which == "matrices" or "layers" in name.split("."))


def make_optimizer(
    decayed: list[torch.Tensor],
    undecayed: list[torch.Tensor],
    cfg: OptimConfig,
    zero_group: dist.ProcessGroup | None = None,
    scratch: Scratch | None = None,
) -> torch.optim.Optimizer | Optimizers:
    """The configured optimizer over two groups, weight decay on the first only (a parameter
    server's shard passes its pieces of matrices and of gains apart), each split by device mesh."""
    groups = [
        *({"params": part, "weight_decay": cfg.weight_decay} for part in by_mesh(decayed)),
        *({"params": part, "weight_decay": 0.0} for part in by_mesh(undecayed)),
    ]
    if cfg.name in ("adamw", "muon"):  # Muon's other parameters: AdamW's
        cls, options = torch.optim.AdamW, {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
    elif cfg.name == "sgd":
        cls, options = torch.optim.SGD, {"lr": cfg.lr, "momentum": cfg.momentum}
    else:
        raise ValueError(f"unknown optimizer {cfg.name!r}")
    options |= kernels([*decayed, *undecayed])
    if scratch is not None:
        assert cls is torch.optim.AdamW, "NVMe offload streams AdamW's moments (validation says so)"
        return NVMeAdamW(groups, scratch, **options)
    optimizers = sharded(groups, cls, options, zero_group)
    return optimizers[0] if len(optimizers) == 1 else Optimizers(*optimizers)


def sharded(
    groups: list[dict], cls: type, options: dict, zero_group: dist.ProcessGroup | None
) -> list[torch.optim.Optimizer]:
    """`cls` over `groups`; under ZeRO-1 (`zero_group`), ZeroRedundancyOptimizer's, each parameter's state whole
    on one rank of the group (Muon's matrices whole, as it needs them)."""
    if zero_group is None:
        return [cls(groups, **options)]
    # ZeroRedundancyOptimizer steps each weight on one rank of the group and sends it to the others: a DTensor's
    # local shards (expert parallelism's experts; ZeRO-1 takes no other parallelism that makes DTensors) differ
    # between them, so theirs is an optimizer of its own, its state whole on each rank holding them
    split: dict[bool, list[dict]] = {True: [], False: []}
    for g in groups:
        split[isinstance(next(iter(g["params"]), None), DTensor)].append(g)
    shared, apart = split[False], split[True]
    zero = [ZeroRedundancyOptimizer(shared, optimizer_class=cls, process_group=zero_group, **options)] if shared else []
    return zero + ([cls(apart, **options)] if apart else [])


def parts(optimizer: torch.optim.Optimizer | Optimizers) -> list[torch.optim.Optimizer]:
    return list(optimizer.parts) if isinstance(optimizer, Optimizers) else [optimizer]


class Optimizers:
    """Optimizers over disjoint parameters, stepped as one (ZeRO-1's and the experts', above): what the step loop
    calls of an optimizer (step, zero_grad, param_groups for the learning rate); `local_optimizers` gives the
    ones whose state a checkpoint holds."""

    def __init__(self, *parts: torch.optim.Optimizer):
        self.parts = parts

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


def by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`params` in one list per device mesh they are DTensors on (or none), in order: a multi-tensor kernel takes
    tensors of one kind (expert parallelism's experts are DTensors on a mesh of their own beside the rest)."""
    parts: dict[object, list[torch.Tensor]] = {}
    for p in params:
        parts.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(parts.values()) or [params]


def kernels(params: list[torch.Tensor]) -> dict[str, bool]:
    """The fused implementation (one kernel for the whole update) where every parameter is on a GPU, the
    multi-tensor `foreach` one elsewhere (CPU, CPU offload): the fastest each device has."""
    return {"fused": True} if params and all(p.is_cuda for p in params) else {"foreach": True}


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: under ZeRO-1, the inner one over its own shard."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def local_optimizers(optimizer: torch.optim.Optimizer | Optimizers) -> list[torch.optim.Optimizer]:
    """Those that hold this rank's state (`local_optimizer`'s of each part): what a checkpoint saves and loads."""
    return [local_optimizer(part) for part in parts(optimizer)]


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine decay to lr * min_lr_ratio at
    decay_steps (max_steps unless set, so a run stopped early and resumed can keep its schedule).

    A pure function of the step: the schedule's whole state is the step number in the checkpoint.
    """
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(cfg.warmup_steps, 1)
    decay_steps = cfg.decay_steps or max_steps
    progress = (step - cfg.warmup_steps) / max(decay_steps - cfg.warmup_steps, 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)
