"""Tensor parallelism: 1-D (Megatron) with DTensor, the model's own plan applied on the mesh's `tp` dim;
2-D, 2.5-D and 3-D on the grid (distrain/parallel/tpnd/), with the model's grid plan (both plans are the
model's methods: distrain/model/contract.py)."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from distrain.model.contract import tie
from distrain.parallel.passes import PassContext
from distrain.parallel.tpnd.grid import Grid
from distrain.parallel.tpnd.layers import apply_grid_tp


def parallelize(model: nn.Module, on: PassContext) -> nn.Module:
    """1-D on the mesh's `tp` dim; a grid on its grid dims, left in `on.grid`: the loss is computed on it
    and (ParallelModel's GradSync) the gradients summed over it."""
    layout = on.layout
    if layout.tp == 1:
        return model
    if layout.tp_mode == "1d":
        apply_tp(model, on.mesh.get("tp"), on.vocab_sharded_loss)
    else:
        on.grid = apply_tp_grid(model, on.mesh.world, layout.tp_mode)
    return model


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, vocab_sharded_loss: bool) -> None:
    """The model's 1-D plan; tied parameters (each split the same way by the plan) made one again. A frozen parameter
    stays frozen (LoRA's base): torch's SequenceParallel makes each parameter it replicates a trainable one."""
    trained = {name: p.requires_grad for name, p in model.named_parameters()}
    parallelize_module(model, tp_mesh, model.tp_plan(vocab_sharded_loss))
    tie(model)
    for name, p in model.named_parameters():
        p.requires_grad_(trained[name])


def apply_tp_grid(model: nn.Module, mesh: DeviceMesh, mode: str) -> Grid:
    plan = model.grid_tp_plan()
    if plan is None:  # validation refuses it before workers start; a direct caller learns here
        raise ValueError(f"{type(model).__name__} has no grid tensor-parallel plan (tp_mode={mode})")
    return apply_grid_tp(model, mesh, mode, plan)


def loss_context(vocab_sharded_loss: bool) -> contextlib.AbstractContextManager:
    """Cross-entropy on vocabulary-sharded logits must run (forward and backward) inside this."""
    return loss_parallel() if vocab_sharded_loss else contextlib.nullcontext()
