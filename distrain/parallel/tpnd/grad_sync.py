"""Gradient reduction for the grid layouts, where neither DDP (which cannot hold DTensors) nor FSDP2
(at most two tensor-parallel placements) applies: each gradient is summed over the data-parallel
ranks and over the grid dims its weight is copied on (2.5-D's depth, a norm's gain), then averaged
over data-parallel ranks. One flat buffer per distinct set of groups, one all-reduce per group."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distrain.parallel.tpnd.comm import Group, all_reduce, size
from distrain.parallel.tpnd.grid import Grid


class GradSync:
    def __init__(self, module: nn.Module, grid: Grid, dp_group: Group):
        self.dp = size(dp_group)
        buckets: dict[tuple[str, ...], list[nn.Parameter]] = {}
        for p in module.parameters():
            buckets.setdefault(grid.copied_dims(p), []).append(p)
        self.buckets = [
            ([dp_group, *(grid.along[d] for d in dims)], params)
            for dims, params in buckets.items()
            if self.dp > 1 or dims
        ]

    @torch.no_grad()
    def __call__(self) -> None:
        for groups, params in self.buckets:
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            for group in groups:
                flat = all_reduce(flat, group)
            flat /= self.dp
            for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))
