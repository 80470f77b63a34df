"""Expert parallelism (the record: distrain/strategy/expert_parallel.py): each mixture-of-experts layer keeps
num_experts / ep of its experts, and its token copies, sorted by expert, travel to their experts' ranks and back.

The experts' weights become DTensors sharded over the `ep` dim of the expert mesh (Shard(0): whole experts), so
a checkpoint holds each expert under its place in the full tensor and loads under any ep, or none. Their
gradients are summed here (`ExpertGradients`), over the ranks holding the same experts, and not by data
parallelism's wrapper, which leaves them out: the wrapper reduces over the whole gradient group."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from distrain.model.moe import Experts, local, moe_layers
from distrain.parallel.passes import PassContext


def parallelize(model: nn.Module, on: PassContext) -> nn.Module:
    """Each MoE layer's experts split over the `ep` ranks, its rows exchanged with them (`exchange`); the expert
    gradients' sum left in `on.experts` for the step to run after its backward, over the experts of every part
    this pass is given (a rank's pipeline stages: several under the looped schedules). Under tensor parallelism the
    experts arrive whole on each rank (Replicate over tp): each tp index splits its copy over its own ep group."""
    mesh = on.mesh.experts
    if mesh is None:
        return model
    layers = moe_layers(model)
    for layer in layers:
        for name, p in list(layer.experts.named_parameters(recurse=False)):
            piece = distribute_tensor(local(p.detach()), mesh["ep"], [Shard(0)], src_data_rank=None)
            layer.experts.register_parameter(name, nn.Parameter(piece, requires_grad=p.requires_grad))
        layer.exchange = functools.partial(exchange, layer.experts, mesh.get_group("ep"), mesh["ep"].size())
    earlier = on.experts.modules if on.experts is not None else []
    modules = [*earlier, *(layer.experts for layer in layers)]
    rest, by_fsdp = on.mesh.expert_rest, on.mesh.expert_shards is not None
    on.experts = ExpertGradients(modules, rest, on.layout.gradient_width, by_fsdp)
    return model


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits, rows `send[r]` to rank r and `recv[r]` from it; its backward is the
    same exchange the other way (torch's own differentiable one is deprecated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def exchange(
    experts: Experts, group: dist.ProcessGroup, ep: int, rows: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """The outputs of `rows`, sorted by expert (`counts[e]` for each of all the experts), from their experts on
    the ep ranks (rank r holds experts r·E/ep to (r+1)·E/ep − 1), in the rows' order. The per-expert counts cross
    first, so that every rank knows the split sizes; the rows a rank receives come by sender, then by expert, and
    are sorted by expert for its local ones."""
    local = counts.numel() // ep
    send = counts.reshape(ep, local)  # row r: the copies for rank r's experts
    got = torch.empty_like(send)  # row s: rank s's copies for this rank's experts
    dist.all_to_all_single(got, send.contiguous(), group=group)
    out_sizes, in_sizes = send.sum(1).tolist(), got.sum(1).tolist()
    arrived = AllToAll.apply(rows, out_sizes, in_sizes, group)
    expert = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(got.flatten())
    order = expert.argsort(stable=True)
    done = experts(arrived[order], got.sum(0))
    return AllToAll.apply(done[order.argsort()], in_sizes, out_sizes, group)


class ExpertGradients:
    """After a step's backward: each expert gradient (its local experts') summed over `ep_rest`, the ranks holding
    the same experts, and divided by the gradient group's width. An expert's gradient on its rank already sums
    what every rank's tokens sent it, so this is the mean over the whole batch that data parallelism takes of the
    other weights. Under ZeRO-2/3 with ep_rest > 1 (`by_fsdp`) FSDP2 shards the experts over ep_rest and
    reduce-scatters their gradients, divided by the same width (data_parallel.shard_experts): nothing left here."""

    def __init__(self, modules: list[Experts], rest: DeviceMesh, width: int, by_fsdp: bool = False):
        self.modules, self.width, self.by_fsdp = modules, width, by_fsdp
        self.group = rest.get_group() if rest.size() > 1 else None

    def params(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def __call__(self) -> None:
        if self.by_fsdp:
            return
        grads = [p.grad.to_local() for p in self.params() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.group is not None:
            dist.all_reduce(flat, group=self.group)
        flat.div_(self.width)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))
