"""The model's layers on the grid, swapped in for its own under the same names, each holding its
weight as a DTensor of the grid's placements and computing on the local block."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor

from distrain.parallel.tpnd.comm import SumReplicated, SumSharded, all_reduce
from distrain.parallel.tpnd.grid import GRIDS, Grid


def grid_weight(weight: torch.Tensor, grid: Grid, role: str) -> nn.Parameter:
    """This rank's block of `weight` (meta or real) as a DTensor parameter; no communication."""
    return nn.Parameter(distribute_tensor(weight.detach(), grid.mesh, grid.placements(role), src_data_rank=None))


class GridLinear(nn.Module):
    def __init__(self, linear: nn.Linear, grid: Grid, role: str):
        super().__init__()
        self.grid, self.role = grid, role
        self.weight = grid_weight(linear.weight, grid, role)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.grid.linear(x, self.weight.to_local(), self.role)


class GridEmbedding(nn.Module):
    """Takes the whole micro-batch's tokens; returns this rank's rows and hidden chunk."""

    def __init__(self, embedding: nn.Embedding, grid: Grid):
        super().__init__()
        self.grid = grid
        self.weight = grid_weight(embedding.weight, grid, "embedding")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.grid.embed(tokens, self.weight.to_local())


class GridRMSNorm(nn.Module):
    """RMSNorm over a hidden dimension split across the grid: the squares' sum is all-reduced."""

    def __init__(self, norm: nn.Module, grid: Grid):
        super().__init__()
        self.grid, self.eps, self.dim = grid, norm.eps, norm.weight.shape[0]
        self.weight = grid_weight(norm.weight, grid, "norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = SumSharded.apply(xf.pow(2).sum(-1, keepdim=True), self.grid.feature_group)
        return (xf * torch.rsqrt(squares / self.dim + self.eps) * self.weight.to_local().float()).type_as(x)


def grid_cross_entropy(grid: Grid, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of the micro-batch from this rank's block of the logits (its rows, its
    vocabulary chunk), never gathered: max, sum of exponentials and the target's logit are reduced
    over the vocabulary group, the rows' losses over the rest. Every rank returns the same value."""
    mine = targets[grid.logit_rows(targets.shape[0])].flatten()
    z = logits.float().flatten(0, 1)
    chunk = z.shape[-1]
    top = all_reduce(z.max(-1).values.detach(), grid.vocab_group, dist.ReduceOp.MAX)
    z = z - top.unsqueeze(-1)
    sum_exp = SumReplicated.apply(z.exp().sum(-1), grid.vocab_group)
    local = mine - grid.head_vocab_chunk() * chunk
    inside = (local >= 0) & (local < chunk)
    picked = z.gather(-1, local.clamp(0, chunk - 1).unsqueeze(-1)).squeeze(-1) * inside
    total = (sum_exp.log() - SumReplicated.apply(picked, grid.vocab_group)).sum()
    for group in grid.row_groups:
        total = SumReplicated.apply(total, group)
    return total / targets.numel()


def apply_grid_tp(model: nn.Module, mesh: DeviceMesh, mode: str, plan: dict[str, str]) -> Grid:
    """Swap the modules the plan names (fqn → role) for their grid versions; returns the grid."""
    grid = GRIDS[mode](mesh)
    for name, role in plan.items():
        parent_name, _, attr = name.rpartition(".")
        parent, module = model.get_submodule(parent_name), model.get_submodule(name)
        if role == "embedding":
            layer = GridEmbedding(module, grid)
        elif role == "norm":
            layer = GridRMSNorm(module, grid)
        else:
            layer = GridLinear(module, grid, role)
        setattr(parent, attr, layer)
    return grid
