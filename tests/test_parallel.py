"""The torch.distributed layer without Ray: mesh, DDP's skipped all-reduce, gradient clipping."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distrain.parallel import strategy
from distrain.parallel.dims import ParallelDims

pytestmark = pytest.mark.usefixtures("process_group")


def test_parallel_dims_fill_data_parallel_and_reject_a_bad_product():
    assert ParallelDims.resolve(8, -1, 1, 2, 2) == ParallelDims(2, 1, 2, 2)
    with pytest.raises(ValueError, match="world size 6"):
        ParallelDims.resolve(6, 2, 1, 2, 2)


def ddp_model() -> tuple[strategy.Strategy, nn.Module, list[int]]:
    mesh = ParallelDims.resolve(1, -1, 1, 1, 1).build_mesh("cpu")
    ddp = strategy.build("ddp", mesh, bucket_cap_mb=25.0)
    model = ddp.apply(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)))
    reductions: list[int] = []

    def count_and_pass(state, bucket):
        reductions.append(1)
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    model.register_comm_hook(None, count_and_pass)
    return ddp, model, reductions


def test_no_sync_skips_the_all_reduce_until_the_last_micro_batch():
    ddp, model, reductions = ddp_model()
    assert ddp.dp_rank_and_size() == (0, 1)
    for i in range(3):
        last = i == 2
        with ddp.no_sync(model) if not last else torch.enable_grad():
            model(torch.randn(4, 8)).sum().backward()
        assert bool(reductions) == last, f"micro-batch {i}"


def test_clip_grad_norm_reports_the_norm_before_clipping():
    ddp, model, _ = ddp_model()
    model(torch.randn(4, 8)).sum().mul(100).backward()
    before = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    reported = ddp.clip_grad_norm(model, max_norm=1.0)
    after = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert reported == pytest.approx(before.item(), rel=1e-6)
    assert after == pytest.approx(1.0, rel=1e-5)
    assert ddp.clip_grad_norm(model, max_norm=0.0) == pytest.approx(1.0, rel=1e-5)  # 0: measure only
