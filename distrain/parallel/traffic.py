"""What one rank sends and receives, counted from the collectives it calls, and what autograd keeps for
the backward: the measured side of docs/tensor-parallel.md, set beside distrain/strategy/tpcost.py's theory.

`Traffic` sees every c10d collective (`dist.broadcast`, `dist.all_gather_into_tensor`, …) and every
functional one (what DTensor's redistributions call), forward and backward alike: CPU autograd runs
the backward in the calling thread, under the same dispatch mode. Bytes follow nccl-tests' convention
(docs/collectives.md), for a group of g ranks and a per-rank message of n bytes: all-reduce sends and
receives 2(g−1)/g·n; all-gather (n: its output), reduce-scatter (n: its input), broadcast and reduce
(g−1)/g·n (a broadcast's or reduce's (g−1)·n bytes shared over its g ranks); send and recv n. An all-to-all
counts exactly what leaves the rank and what reaches it, its own share left out: (g−1)/g·n when its splits
are even, and with uneven ones (expert parallelism's tokens) what its split sizes say.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

c10d, funcol = torch.ops.c10d, torch.ops._c10d_functional

# op → (kind, index of the argument holding the message, whether n is that argument × the group size)
# c10d's ops take the process group as an argument; the functional ones name it (their last argument).
OPS = {
    c10d.broadcast_: ("broadcast", 0, False),
    c10d.reduce_: ("reduce", 0, False),
    c10d.allreduce_: ("all_reduce", 0, False),
    c10d.allreduce_coalesced_: ("all_reduce", 0, False),
    c10d._allgather_base_: ("all_gather", 0, False),
    c10d.allgather_: ("all_gather", 0, False),
    c10d.allgather_coalesced_: ("all_gather", 0, False),
    c10d.allgather_into_tensor_coalesced_: ("all_gather", 0, False),
    c10d._reduce_scatter_base_: ("reduce_scatter", 1, False),
    c10d.reduce_scatter_: ("reduce_scatter", 1, False),
    c10d.reduce_scatter_tensor_coalesced_: ("reduce_scatter", 1, False),
    c10d.alltoall_: ("all_to_all", 1, False),
    c10d.alltoall_base_: ("all_to_all", 1, False),
    c10d.send: ("send", 0, False),
    c10d.recv_: ("recv", 0, False),
    c10d.recv_any_source_: ("recv", 0, False),
    funcol.broadcast: ("broadcast", 0, False),
    funcol.broadcast_: ("broadcast", 0, False),
    funcol.all_reduce: ("all_reduce", 0, False),
    funcol.all_reduce_: ("all_reduce", 0, False),
    funcol.all_reduce_coalesced: ("all_reduce", 0, False),
    funcol.all_reduce_coalesced_: ("all_reduce", 0, False),
    funcol.all_gather_into_tensor: ("all_gather", 0, True),
    funcol.all_gather_into_tensor_out: ("all_gather", 0, True),
    funcol.all_gather_into_tensor_coalesced: ("all_gather", 0, True),
    funcol.reduce_scatter_tensor: ("reduce_scatter", 0, False),
    funcol.reduce_scatter_tensor_coalesced: ("reduce_scatter", 0, False),
    funcol.all_to_all_single: ("all_to_all", 0, False),
}
UNCOUNTED = {c10d.barrier}  # a synchronisation, not data


def nbytes(x: object) -> int:
    """The bytes of a tensor, or of every tensor in a (nested) list of them."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(nbytes(t) for t in x) if isinstance(x, list | tuple) else 0


def process_group(func: torch._ops.OpOverload, args: tuple) -> dist.ProcessGroup:
    """The group a collective's arguments name."""
    if func._overloadpacket._qualified_op_name.startswith("_c10d_functional::"):
        return _resolve_process_group(args[-1])
    at = next(i for i, a in enumerate(func._schema.arguments) if "ProcessGroup" in str(a.type))
    group = args[at]  # the TorchScript object that boxes the ProcessGroup
    return group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)


def all_to_all_bytes(func: torch._ops.OpOverload, args: tuple) -> tuple[float, float]:
    """(sent, received): an all-to-all's bytes to and from the other ranks, this rank's rows for itself left out.
    c10d's lists of tensors, one per rank; or one tensor of rows, split by the split sizes (none: evenly)."""
    group = process_group(func, args)
    g, me = group.size(), group.rank()
    if func._overloadpacket is c10d.alltoall_:
        outputs, inputs = args[0], args[1]
        return nbytes(inputs) - nbytes(inputs[me]), nbytes(outputs) - nbytes(outputs[me])
    # c10d's (output, input, group, output splits, input splits); the functional (input, output splits, input splits)
    x, out_rows, in_rows = (args[1], *args[3:5]) if func._overloadpacket is c10d.alltoall_base_ else args[:3]
    even = [x.shape[0] // g] * g
    out_rows, in_rows = list(out_rows) or even, list(in_rows) or even
    row = nbytes(x) / max(x.shape[0], 1)
    return row * (sum(in_rows) - in_rows[me]), row * (sum(out_rows) - out_rows[me])


class Traffic(TorchDispatchMode):
    """While entered, each collective this rank calls: `ops[kind]` = {"calls", "sent", "received"} in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, dict[str, float]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # a DTensor first decomposes into plain ops and collectives, which come back here
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "_overloadpacket", None)
        if packet in OPS:
            self.count(packet, func, args if not kwargs else (*args, *kwargs.values()))
        elif packet is not None and packet not in UNCOUNTED and packet._qualified_op_name.startswith("c10d::"):
            raise NotImplementedError(f"traffic: {packet} is not counted")
        return out

    def count(self, packet: object, func: torch._ops.OpOverload, args: tuple) -> None:
        kind, at, times_group = OPS[packet]
        g = process_group(func, args).size()
        n = nbytes(args[at]) * (g if times_group else 1)
        if kind in ("send", "recv"):
            sent, received = (n, 0) if kind == "send" else (0, n)
        elif kind == "all_to_all":
            sent, received = all_to_all_bytes(func, args)
        else:
            share = n * (g - 1) / g * (2 if kind == "all_reduce" else 1)
            sent = received = share
        row = self.ops.setdefault(kind, {"calls": 0, "sent": 0.0, "received": 0.0})
        row["calls"] += 1
        row["sent"] += sent
        row["received"] += received

    def total(self, what: str = "sent") -> float:
        return sum(row[what] for row in self.ops.values())


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage holding a tensor's bytes: a wrapper subclass's (a DTensor's local shard, an
    AsyncCollectiveTensor's result) is its inner tensor's."""
    while is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        t = getattr(t, names[0])
    return t.untyped_storage()


@contextlib.contextmanager
def saved_activations(model: nn.Module, inside: Iterable[nn.Module] = ()) -> Iterator[dict[str, int]]:
    """While entered, the bytes autograd saves for the backward, each storage once, the model's parameters
    and buffers left out (held anyway): `held["bytes"]` of them all, `held["inside"]` of those saved while
    one of the `inside` modules (the blocks) ran. Saved tensors live until the backward, so after one
    forward pass this is what the rank holds for it."""
    state = {storage_of(t).data_ptr() for t in (*model.parameters(), *model.buffers())}
    depth, seen = [0], {}  # storage → (bytes, saved inside)
    held = {"bytes": 0, "inside": 0}
    hooks = []
    for m in inside:
        hooks.append(m.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1)))
        hooks.append(m.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = storage_of(t)
        if s.data_ptr() not in state and s.nbytes() and s.data_ptr() not in seen:
            seen[s.data_ptr()] = (s.nbytes(), depth[0] > 0)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield held
    finally:
        for h in hooks:
            h.remove()
        held["bytes"] = sum(b for b, _ in seen.values())
        held["inside"] = sum(b for b, ins in seen.values() if ins)
