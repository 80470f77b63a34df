"""One DeviceMesh for the whole layout: the single source of every process group."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

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
