"""The process group's lifecycle in one worker process: a group formed again after the last ended (a warm
worker's next attempt or run) gets device meshes of its own, never those of the groups before it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import free_port, rank_env, spawn_ranks

WORLD = 4


def rank_main(rank: int, ports: list[int], out: str) -> None:
    """Two groups one after the other, the first with three groups more before its mesh (so the mesh's groups get
    other names than in the second), each taking the norm of a DTensor sharded over a (2, 2) mesh's inner dim:
    the reduction runs in the inner dim's group, resolved by its name."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from distrain.parallel import process_group

    norms = []
    for extra, port in zip((3, 0), ports, strict=True):
        rank_env(rank, WORLD, port, CUDA_VISIBLE_DEVICES="")
        process_group.init_from_env()
        for _ in range(extra):
            dist.new_group(list(range(WORLD)))
        inner = DeviceMesh("cpu", torch.arange(WORLD).reshape(2, 2), mesh_dim_names=("outer", "inner"))["inner"]
        piece = distribute_tensor(torch.arange(4.0), inner, [Shard(0)], src_data_rank=None)
        norms.append(torch.nn.utils.get_total_norm([piece]).full_tensor().item())
        process_group.destroy()
    Path(out, f"rank{rank}.json").write_text(json.dumps(norms))


@pytest.mark.timeout(120)
def test_a_group_formed_again_builds_its_meshes_anew(tmp_path: Path) -> None:
    spawn_ranks(rank_main, ([free_port(), free_port()], str(tmp_path)), WORLD)
    for rank in range(WORLD):  # √(0² + 1² + 2² + 3²), in both groups
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [pytest.approx(14**0.5)] * 2
