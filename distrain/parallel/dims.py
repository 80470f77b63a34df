"""Parallel dimensions → one DeviceMesh, the single source of every process group."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int

    @classmethod
    def resolve(cls, world_size: int, dp_replicate: int, dp_shard: int, tp: int, pp: int) -> ParallelDims:
        """Fill dp_replicate=-1 with the workers the other dimensions leave over."""
        if dp_replicate < 1:
            dp_replicate = world_size // (dp_shard * tp * pp)
        dims = cls(dp_replicate, dp_shard, tp, pp)
        if dims.world_size != world_size:
            raise ValueError(f"{dims} covers {dims.world_size} ranks, not the world size {world_size}")
        return dims

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Outermost to innermost: pp, dp_replicate, dp_shard, tp, so that tensor-parallel peers
        are neighbouring ranks (the same node, once placement sorts ranks by node)."""
        names = ("pp", "dp_replicate", "dp_shard", "tp")
        sizes = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        kept = [(n, s) for n, s in zip(names, sizes, strict=True) if s > 1] or [("dp_replicate", 1)]
        return init_device_mesh(device_type, tuple(s for _, s in kept), mesh_dim_names=tuple(n for n, _ in kept))
