"""The traffic counter (distrain/parallel/traffic.py) on real gloo collectives, and the saved-activation
count: each collective on each rank counts exactly the bytes of docs/collectives.md's convention, for
groups of 2 (subgroups) and of 4 (the world), forward and backward, c10d and DTensor's functional ops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import free_port, rank_env, spawn_ranks

WORLD = 4
N = 24  # float32 elements of each message: 96 bytes, divisible over 2 and 4 ranks


def rank_main(rank: int, port: int, out: str) -> None:
    """Every case on every rank, under its own Traffic: the counts to a file."""
    rank_env(rank, WORLD, port, CUDA_VISIBLE_DEVICES="")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from distrain.compat import all_gather_single, reduce_scatter_single
    from distrain.parallel import process_group
    from distrain.parallel.traffic import Traffic

    process_group.init_from_env()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    pair = mesh.get_group("inner")  # {0, 1} or {2, 3}: a subgroup of 2
    results = {}

    class SumBack(torch.autograd.Function):  # identity forward; backward all-reduces the gradient
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            dist.all_reduce(grad, group=pair)
            return grad

    def x(n: int = N) -> torch.Tensor:
        return torch.ones(n)

    for name, group in (("pair", pair), ("world", dist.group.WORLD)):
        g = group.size()
        cases = {
            "broadcast": lambda group=group: dist.broadcast(x(), group=group, group_src=0),
            "reduce": lambda group=group: dist.reduce(x(), group=group, group_dst=0),
            "all_reduce": lambda group=group: dist.all_reduce(x(), group=group),
            "all_gather": lambda group=group, g=g: all_gather_single(x(), x(N // g), group=group),
            "all_gather_list": lambda group=group, g=g: dist.all_gather([x(N // g)] * g, x(N // g), group=group),
            "reduce_scatter": lambda group=group, g=g: reduce_scatter_single(x(N // g), x(), group=group),
        }
        for case, call in cases.items():
            with Traffic() as t:
                call()
            results[f"{name}/{case}"] = t.ops
        with Traffic() as t:  # within each pair, the first sends to the second
            (dist.send(x(), group=pair, group_dst=1) if pair.rank() == 0 else dist.recv(x(), group=pair, group_src=0))
        results["pair/sendrecv"] = t.ops
    # DTensor: a redistribution forward (all-gather), one in the backward (Shard → Replicate of the gradient),
    # and an autograd function's own collective in the backward.
    with Traffic() as t:
        DTensor.from_local(x(N // 2), mesh["inner"], [Shard(0)]).redistribute(placements=[Replicate()]).to_local()
    results["dtensor/forward"] = t.ops
    leaf = torch.ones(N, requires_grad=True)
    with Traffic() as t:
        d = DTensor.from_local(leaf, mesh["inner"], [Replicate()]).redistribute(placements=[Shard(0)])
        SumBack.apply(d.to_local()).sum().backward()
    results["dtensor/backward"] = t.ops
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    process_group.destroy()


def expected(case: str, rank: int) -> dict[str, dict[str, float]]:
    """The convention's bytes (docs/collectives.md) for a message of N float32 on this rank."""
    n = 4 * N
    group, op = case.split("/")
    g = 2 if group in ("pair", "dtensor") else WORLD
    share = (g - 1) / g * n
    kind = {"all_gather_list": "all_gather"}.get(op, op)
    if op == "sendrecv":
        sends = rank % 2 == 0
        return {"send" if sends else "recv": {"calls": 1, "sent": n if sends else 0, "received": 0 if sends else n}}
    if op == "forward":
        return {"all_gather": {"calls": 1, "sent": share, "received": share}}
    if op == "backward":  # the gradient gathered (N elements out), then SumBack's all-reduce of N // 2
        return {
            "all_gather": {"calls": 1, "sent": share, "received": share},
            "all_reduce": {"calls": 1, "sent": share, "received": share},
        }
    factor = 2 if op == "all_reduce" else 1
    return {kind: {"calls": 1, "sent": factor * share, "received": factor * share}}


@pytest.mark.timeout(120)
def test_counts_follow_the_convention(tmp_path: Path) -> None:
    spawn_ranks(rank_main, (free_port(), str(tmp_path)), WORLD)
    for rank in range(WORLD):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case, ops in got.items():
            assert ops == expected(case, rank), f"rank {rank} {case}: {ops}"
        assert len(got) == 15  # 6 collectives × 2 groups, send/recv, 2 DTensor cases


@pytest.mark.timeout(30)
def test_saved_activations_count_each_storage_once() -> None:
    """A linear layer saves its input (its weight is a parameter: left out); ReLU saves its output; the
    input saved twice (two linears) counts once."""
    import torch
    from torch import nn

    from distrain.parallel.traffic import saved_activations

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.act = nn.Linear(8, 4), nn.Linear(8, 4), nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.a(x)) + self.b(x)

    model, x = Two(), torch.randn(3, 8)
    with saved_activations(model, inside=[model.act]) as held:
        model(x).sum().backward()
    assert held == {"bytes": 3 * 8 * 4 + 3 * 4 * 4, "inside": 3 * 4 * 4}
