"""Tensor parallelism with DTensor: the model's own plan, applied on the mesh's `tp` dim."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from distrain.model.llama import tp_plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, vocab_sharded_loss: bool) -> None:
    parallelize_module(model, tp_mesh, tp_plan(model, vocab_sharded_loss))


def loss_context(vocab_sharded_loss: bool) -> contextlib.AbstractContextManager:
    """Cross-entropy on vocabulary-sharded logits must run (forward and backward) inside this."""
    return loss_parallel() if vocab_sharded_loss else contextlib.nullcontext()
