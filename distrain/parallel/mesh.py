"""One rank's device meshes for its layout, built once: the single source of every process group.

`ParallelMesh` holds the layout (the sizes, which the driver resolved without torch) and, on a rank with a
process group, the device mesh over the layout's mesh dims, each named, and the flattened gradient mesh
(data parallelism's dims with cp folded in), as torchtitan's ParallelDims holds its world mesh and the
meshes flattened from it. Dims of size 1 are left out of the mesh (no groups to build). A new dim is a new
record in distrain/strategy/; this file builds whatever dims the layout has. Expert parallelism, which borrows
ranks of the gradient group rather than adding a dim, gets a mesh of its own over them (`experts`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distrain.strategy.data_parallel import DIMS as DP_DIMS
from distrain.strategy.expert_parallel import expert_shard_ranks
from distrain.strategy.layout import Layout


class ParallelMesh:
    """The layout, its device mesh (`world`) and its gradient mesh; `collective=False` builds none (a
    parameter-server worker, whose gradients travel to the servers instead): both are then None."""

    def __init__(self, layout: Layout, device_type: str, sharded: bool, collective: bool = True):
        self.layout, self.sharded = layout, sharded  # sharded: ZeRO-2/3's FSDP2
        self.world: DeviceMesh | None = None
        self.gradient: DeviceMesh | None = None  # the dims whose ranks sum their gradients; None where none are
        self.experts: DeviceMesh | None = None  # (ep_other, ep_replicate, ep_shard, ep), under EP
        self.expert_rest: DeviceMesh | None = None  # its ep_rest: (ep_replicate, ep_shard) flattened
        if collective:
            kept = [(name, size) for name, size in layout.mesh_sizes().items() if size > 1] or [("dp_replicate", 1)]
            names = tuple(n for n, _ in kept)
            self.world = init_device_mesh(device_type, tuple(s for _, s in kept), mesh_dim_names=names)
            self.gradient = self._gradient_mesh(sharded)
            if layout.settings.get("ep", 1) > 1:
                self.experts = self._expert_mesh(device_type)

    def get(self, dim: str) -> DeviceMesh:
        """The mesh along one dim of size > 1."""
        assert self.world is not None, f"no device mesh to take {dim} from: built without a process group"
        return self.world[dim]

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.get(dim).get_group()

    def _expert_mesh(self, device_type: str) -> DeviceMesh:
        """Each gradient group's ranks (dp_replicate, dp_shard, cp, row-major) as an (ep_rest, ep) grid, ep
        innermost: `ep` splits the experts, `ep_rest` holds the same ones. Every rank builds every group's.
        `ep_rest` is flattened from (ep_replicate, ep_shard), ep_shard the ranks ZeRO-2/3 shards the experts over
        (`expert_shards`, strategy/expert_parallel.py's expert_shard_ranks). One root grid for all: FSDP2 joins
        its mesh and the experts' `ep` into one, which needs them sliced from the same root."""
        layout, grad = self.layout, (*DP_DIMS, "cp")
        others = [d for d in layout.dims if d not in grad]
        order = [list(layout.dims).index(d) for d in (*others, *grad)]
        ranks = torch.arange(layout.world_size).reshape(tuple(layout.dims.values())).permute(order)
        shards = expert_shard_ranks(layout)
        split = (layout.gradient_width // layout.ep // shards, shards)
        grid = ranks.reshape(-1, *split, layout.ep)
        mesh = DeviceMesh(device_type, grid, mesh_dim_names=("ep_other", "ep_replicate", "ep_shard", "ep"))
        self.expert_rest = mesh[("ep_replicate", "ep_shard")]._flatten("ep_rest")
        return mesh

    @property
    def expert_shards(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards the experts over under ZeRO-2/3, ep_rest's share of the gradient
        mesh: `ep_shard`, or (`ep_replicate`, `ep_shard`) under HSDP, whose replicas then hold the same shards.
        None where it has one rank (ep takes all of dp_shard × cp, or crosses HSDP's replicas): the experts stay
        out of FSDP2, whole on their ranks (ExpertGradients sums them)."""
        mesh = self.experts
        if not self.sharded or mesh is None or mesh["ep_shard"].size() == 1:
            return None
        return mesh[("ep_replicate", "ep_shard")] if self.layout.dp_replicate > 1 else mesh["ep_shard"]

    def _gradient_mesh(self, sharded: bool) -> DeviceMesh | None:
        """The dims whose ranks hold the same weights and sum their gradients: the data-parallel ones and cp
        (whose ranks hold different tokens of the same sequences). cp is folded into dp_shard, as torchtitan
        folds it (dp_shard_cp): one flattened dim that DDP reduces over and FSDP2 shards over; under HSDP
        (`sharded` with dp_replicate) the mesh is (dp_replicate, dp_shard_cp)."""
        mesh = self.world
        present = tuple(n for n in mesh.mesh_dim_names if n in (*DP_DIMS, "cp"))
        if "cp" not in present:
            if not present:
                return None
            return mesh[present] if len(present) > 1 else mesh[present[0]]
        if len(present) == 1:
            return mesh["cp"]
        if sharded and "dp_replicate" in present and len(present) == 3:
            mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
            return mesh[("dp_replicate", "dp_shard_cp")]
        return mesh[present]._flatten("dp_cp")
