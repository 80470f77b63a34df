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
from distrain.strategy.layout import Layout


class ParallelMesh:
    """The layout, its device mesh (`world`) and its gradient mesh; `collective=False` builds none (a
    parameter-server worker, whose gradients travel to the servers instead): both are then None."""

    def __init__(self, layout: Layout, device_type: str, sharded: bool, collective: bool = True):
        self.layout = layout
        self.world: DeviceMesh | None = None
        self.gradient: DeviceMesh | None = None  # the dims whose ranks sum their gradients; None where none are
        self.experts: DeviceMesh | None = None  # (ep_rest, ep) over this rank's gradient group, under EP
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
        innermost: `ep` splits the experts, `ep_rest` holds the same ones. Every rank builds every group's."""
        layout, grad = self.layout, (*DP_DIMS, "cp")
        others = [d for d in layout.dims if d not in grad]
        order = [list(layout.dims).index(d) for d in (*others, *grad)]
        ranks = torch.arange(layout.world_size).reshape(tuple(layout.dims.values())).permute(order)
        grid = ranks.reshape(-1, layout.gradient_width // layout.ep, layout.ep)
        mesh = DeviceMesh(device_type, grid, mesh_dim_names=("ep_other", "ep_rest", "ep"))
        return mesh[("ep_rest", "ep")]

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
