"""The Strategy interface every parallelism implements, and the registry that picks one by name."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


class Strategy:
    """Wraps a model for one layout of the mesh; the training loop sees only these methods."""

    def __init__(self, mesh: DeviceMesh, **options):
        self.mesh = mesh
        self.options = options

    def apply(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context for a non-final micro-batch: accumulate gradients without a collective."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Total gradient norm over the whole model; clip to max_norm when it is positive."""
        return nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))

    def dp_rank_and_size(self) -> tuple[int, int]:
        """This rank's slice of the global batch: its coordinate over the data-parallel dims."""
        rank, size = 0, 1
        for name, coord, dim in zip(self.mesh.mesh_dim_names, self.mesh.get_coordinate(), self.mesh.shape, strict=True):
            if name in ("dp_replicate", "dp_shard"):
                rank, size = rank * dim + coord, size * dim
        return rank, size


_REGISTRY: dict[str, Callable[..., Strategy]] = {}


def register(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    def wrap(cls: type[Strategy]) -> type[Strategy]:
        _REGISTRY[name] = cls
        return cls

    return wrap


def build(name: str, mesh: DeviceMesh, **options) -> Strategy:
    from distrain.parallel import ddp  # noqa: F401  (registers the built-in strategies)

    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](mesh, **options)
