"""ZeRO's memory claims, measured: bytes of parameters, gradients and optimizer state per rank for
ZeRO-0/1/2/3 on 4 ranks, each within 10% of theory. Four gloo processes, no Ray (a parallel-layer test)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from conftest import free_port

WORLD = 4
ADAMW_STATES = 2  # exp_avg, exp_avg_sq per parameter


def measure(rank: int, port: int, out: str) -> None:
    """One rank: for each ZeRO level, one training step of the tiny model; its bytes to a file."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    import torch

    from distrain.config import ModelConfig, OptimConfig, StrategyConfig
    from distrain.layout import MeshSizes
    from distrain.model.llama import Transformer
    from distrain.parallel import process_group
    from distrain.parallel.memory import state_bytes
    from distrain.parallel.parallelize import ParallelModel
    from distrain.train.loop import cross_entropy
    from distrain.train.optim import build_optimizer, local_optimizer

    device = process_group.init_from_env()
    results = {}
    for zero in range(4):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=2, ffn_dim=64), 32)
        sizes = MeshSizes(pp=1, dp_replicate=1 if zero else WORLD, dp_shard=WORLD if zero else 1, tp=1)
        parallel = ParallelModel(model, StrategyConfig(zero=zero), sizes, device, False, 1, cross_entropy)
        optimizer = build_optimizer(parallel.module, OptimConfig(), parallel.zero1_group)
        batch = torch.randint(0, 256, (2, 32))

        def step(parallel=parallel, optimizer=optimizer, x=batch) -> None:  # bound now, not at loop end
            parallel.forward_backward(x, x)
            optimizer.step()

        results[zero] = state_bytes(parallel.module, local_optimizer(optimizer), step)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    process_group.destroy()


def test_zero_memory_matches_theory(tmp_path: Path):
    from distrain.config import ModelConfig
    from distrain.model.size import num_params

    mp.spawn(measure, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    p = num_params(ModelConfig(dim=32, n_layers=2, n_heads=2, ffn_dim=64)) * 4  # fp32 bytes
    k, n = ADAMW_STATES * p, WORLD
    theory = {
        "0": {"params": p, "grads": p, "optimizer": k},
        "1": {"params": p, "grads": p, "optimizer": k / n},
        "2": {"params": p, "grads": p / n, "optimizer": k / n},
        "3": {"params": p / n, "grads": p / n, "optimizer": k / n},
    }
    for rank in range(WORLD):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for zero, expected in theory.items():
            for kind, bytes_ in expected.items():
                got = measured[zero][kind]
                assert got == pytest.approx(bytes_, rel=0.10), f"rank {rank} ZeRO-{zero} {kind}: {got} vs {bytes_:.0f}"
