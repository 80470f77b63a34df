"""Tensor parallelism: 1-D (Megatron) with DTensor, the model's own plan applied on the mesh's `tp` dim;
2-D, 2.5-D and 3-D on the grid (distrain/parallel/tpnd/), with the model's grid plan."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from distrain.model.llama import grid_tp_plan, tp_plan
from distrain.parallel.tpnd.grid import Grid
from distrain.parallel.tpnd.layers import apply_grid_tp


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, vocab_sharded_loss: bool) -> None:
    parallelize_module(model, tp_mesh, tp_plan(model, vocab_sharded_loss))


def apply_tp_grid(model: nn.Module, mesh: DeviceMesh, mode: str) -> Grid:
    return apply_grid_tp(model, mesh, mode, grid_tp_plan(model))


def loss_context(vocab_sharded_loss: bool) -> contextlib.AbstractContextManager:
    """Cross-entropy on vocabulary-sharded logits must run (forward and backward) inside this."""
    return loss_parallel() if vocab_sharded_loss else contextlib.nullcontext()
