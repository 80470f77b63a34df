"""The collectives the grid layers are built from, as autograd functions: each forward's communication
and the backward's that mirrors it. All work on dim 0 (rows: the batch, or a weight's first dim), which
gloo's all-gather and reduce-scatter concatenate along. A group of None is a grid dim of size 1."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from distrain.compat import all_gather_single, reduce_scatter_single

Group = ProcessGroup | None


def size(group: Group) -> int:
    return 1 if group is None else group.size()


def index(group: Group) -> int:
    """This rank's index in the group (its coordinate along the grid dim)."""
    return 0 if group is None else group.rank()


def all_gather(x: torch.Tensor, group: Group) -> torch.Tensor:
    if size(group) == 1:
        return x
    out = x.new_empty((size(group) * x.shape[0], *x.shape[1:]))
    all_gather_single(out, x.contiguous(), group=group)
    return out


def reduce_scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    if size(group) == 1:
        return x
    out = x.new_empty((x.shape[0] // size(group), *x.shape[1:]))
    reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def all_reduce(x: torch.Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    if size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, op=op, group=group)
    return x


def broadcast(x: torch.Tensor, group: Group, src: int) -> torch.Tensor:
    """Group member `src`'s x, on every member (a fresh tensor elsewhere, x itself on src)."""
    if size(group) == 1:
        return x
    out = x.contiguous() if index(group) == src else torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.broadcast(out, group=group, group_src=src)
    return out


def reduce(x: torch.Tensor, group: Group, dst: int) -> torch.Tensor:
    """The sum of every member's x, valid on member `dst` only."""
    if size(group) > 1:
        x = x.contiguous()
        dist.reduce(x, group=group, group_dst=dst)
    return x


class Mirrored(torch.autograd.Function):
    """A collective whose backward is its mirror image: an all-gather's gradient is reduce-scattered,
    a reduce-scatter's all-gathered."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, forward: Callable, backward: Callable) -> torch.Tensor:
        ctx.group, ctx.mirror = group, backward
        return forward(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.mirror(grad, ctx.group), None, None, None


def gather_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Rows from every member, in member order; backward: each member's rows of the summed gradient."""
    return Mirrored.apply(x, group, all_gather, reduce_scatter)


def scatter_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum over members, each keeping its rows; backward: every member's rows of the gradient."""
    return Mirrored.apply(x, group, reduce_scatter, all_gather)


class SumSharded(torch.autograd.Function):
    """A sum over members whose consumers differ (each uses it on its own slice of features): the
    gradient of each member's part is the sum of every consumer's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad.clone(), ctx.group), None


class SumReplicated(torch.autograd.Function):
    """A sum over members whose consumers are identical copies (the loss, and what leads only to it):
    each member's part gets the gradient once, not once per copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
