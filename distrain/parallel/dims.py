"""One DeviceMesh for the whole layout: the single source of every process group."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distrain.strategy.data_parallel import DIMS as DP_DIMS
from distrain.strategy.layout import Layout


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """Dims of size 1 are left out (no groups to build); `submesh` treats them as absent."""
    kept = [(name, size) for name, size in layout.mesh_sizes().items() if size > 1] or [("dp_replicate", 1)]
    return init_device_mesh(device_type, tuple(s for _, s in kept), mesh_dim_names=tuple(n for n, _ in kept))


def submesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh | None:
    """The mesh over those of `names` that exist (in mesh order), or None if none does."""
    present = tuple(n for n in mesh.mesh_dim_names if n in names)
    if not present:
        return None
    return mesh[present] if len(present) > 1 else mesh[present[0]]


def gradient_mesh(mesh: DeviceMesh, sharded: bool) -> DeviceMesh | None:
    """The dims whose ranks hold the same weights and sum their gradients: the data-parallel ones and cp
    (whose ranks hold different tokens of the same sequences). cp is folded into dp_shard, as torchtitan
    folds it (dp_shard_cp): one flattened dim that DDP reduces over and FSDP2 shards over; under HSDP
    (`sharded` with dp_replicate) the mesh is (dp_replicate, dp_shard_cp)."""
    present = tuple(n for n in mesh.mesh_dim_names if n in (*DP_DIMS, "cp"))
    if "cp" not in present:
        return submesh(mesh, DP_DIMS)
    if len(present) == 1:
        return mesh["cp"]
    if sharded and "dp_replicate" in present and len(present) == 3:
        mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
        return mesh[("dp_replicate", "dp_shard_cp")]
    return mesh[present]._flatten("dp_cp")
