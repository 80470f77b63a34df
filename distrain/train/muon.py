"""Muon (Keller Jordan's: Nesterov momentum, then the update orthogonalised by five Newton–Schulz steps) on the
blocks' matrices, correct under every layout.

The orthogonalisation needs each matrix whole, and a layout may hold only a shard of it (a DTensor: FSDP2's
ZeRO-2/3 and HSDP, tensor parallelism's columns or rows). Matrices of one shape and placement are taken
together, as many as the shards' ranks: stacked, each rank's update is a DTensor sharded along the matrices'
own dims, and redistributed to be sharded along the stack, so that each rank holds one of the matrices whole
(an all-to-all, DTensor's own). Each rank orthogonalises its matrix, and the reverse redistribution sends
the shards back. The work is spread: no rank orthogonalises more than its share of the matrices (the
distributed Muon of Moonlight and Dion). A replicated dim of the mesh (HSDP's replicas) repeats the work on
each replica, as their gradients are the same. Whole matrices (DDP, ZeRO-1's shard of whole parameters,
pipeline stages) are orthogonalised where they are.

The single matrix's math is PyTorch's (torch.optim.Muon's Newton–Schulz, in bfloat16, so the updates travel
in bfloat16: half the bytes and the same result); the update is scaled by Moonlight's RMS matching,
0.2·√max(rows, columns), so one learning rate serves Muon's matrices and AdamW's other parameters.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz

COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)  # (3.4445, -4.7750, 2.0315): Keller Jordan's quintic
RMS_MATCH = 0.2  # Moonlight: the update's RMS as AdamW's, about 0.2 to 0.4


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters, plain tensors or DTensors of any placement; its state (`momentum_buffer`, as
    torch.optim.Muon names it) is laid out as its parameter, so checkpoints are layout-free."""

    def __init__(self, params: list, lr: float, momentum: float = 0.95, weight_decay: float = 0.0, ns_steps: int = 5):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "ns_steps": ns_steps})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            updates = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                updates.append(p.grad.lerp(buf, group["momentum"]))  # Nesterov
            for p, o in zip(params, orthogonalise(updates, group["ns_steps"]), strict=True):
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(o, alpha=-group["lr"] * RMS_MATCH * math.sqrt(max(p.shape)))


def newton_schulz(update: torch.Tensor, steps: int) -> torch.Tensor:
    return _zeropower_via_newtonschulz(update, COEFFICIENTS, steps, EPS)


def orthogonalise(updates: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    """Each update orthogonalised whole, laid out as it came: sharded ones through `spread`, in batches of
    one shape and placement."""
    out: list[torch.Tensor | None] = [None] * len(updates)
    batches: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        if isinstance(u, DTensor) and any(splits(p) for p in u.placements):
            batches.setdefault((u.shape, u.device_mesh, u.placements), []).append(i)
        elif isinstance(u, DTensor):  # replicated: each rank holds it whole
            out[i] = DTensor.from_local(newton_schulz(u.to_local(), steps), u.device_mesh, u.placements)
        else:
            out[i] = newton_schulz(u, steps)
    for members in batches.values():
        owners = holders(updates[members[0]])
        for start in range(0, len(members), owners):
            chunk = members[start : start + owners]
            for i, o in zip(chunk, spread([updates[i] for i in chunk], owners, steps), strict=True):
                out[i] = o
    return out


def holders(u: DTensor) -> int:
    """How many ranks hold different shards of `u`: the product of its sharded mesh dims' sizes."""
    return math.prod(u.device_mesh.size(d) for d, p in enumerate(u.placements) if splits(p))


def spread(chunk: list[DTensor], owners: int, steps: int) -> list[DTensor]:
    """Up to `owners` matrices of one shape and placement, each gathered whole on one rank (zeros fill a short
    batch), orthogonalised there, and its shards sent back."""
    first = chunk[0]
    mesh, placements = first.device_mesh, first.placements
    home, device = first.to_local().device, mesh.device_type  # CPU offload: the shards live on the host
    locals_ = [u.to_local().to(device, torch.bfloat16) for u in chunk]
    locals_ += [torch.zeros_like(locals_[0])] * (owners - len(chunk))
    shape = torch.Size([owners, *first.shape])
    stacked = DTensor.from_local(
        torch.stack(locals_), mesh, along_matrix(placements), shape=shape, stride=contiguous_stride(shape)
    )
    by_matrix = [Shard(0) if splits(p) else Replicate() for p in placements]
    mine = stacked.redistribute(mesh, by_matrix).to_local()
    done = torch.stack([newton_schulz(m, steps) for m in mine])
    back = DTensor.from_local(done, mesh, by_matrix, shape=shape, stride=contiguous_stride(shape))
    pieces = back.redistribute(mesh, along_matrix(placements)).to_local()[: len(chunk)].to(home)
    return [
        DTensor.from_local(o, mesh, placements, shape=u.shape, stride=u.stride())
        for o, u in zip(pieces, chunk, strict=True)
    ]


def splits(p: Placement) -> bool:
    """Whether `p` splits the tensor over its mesh dim (a gradient's placement is a shard or a replica)."""
    return not p.is_replicate()


def along_matrix(placements: tuple) -> list:
    """A matrix's placements as those of a stack of such matrices: each shard one dim further."""
    return [shifted(p) if splits(p) else p for p in placements]


def shifted(p: Placement) -> Placement:
    """`p` one dim further; FSDP2's strided shard of a tensor-parallel shard keeps its split factor."""
    return Shard(p.dim + 1) if type(p) is Shard else type(p)(p.dim + 1, split_factor=p.split_factor)


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()
