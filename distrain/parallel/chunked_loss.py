"""The head and the loss over slices of the sequence (`trainer.loss_chunk`), so that neither the forward nor the
backward holds a micro-batch's whole logits: batch × seq × vocab in fp32 is the largest single activation of a
long sequence or a large vocabulary (4 GiB a sequence at 8k tokens and a 128k vocabulary).

The model returns its final hidden states (`head_skipped`, distrain/model/contract.py) and the loss calls the head
itself, once a slice, through whatever wraps it (1-D tensor parallelism's DTensor plan, the grid's layers, FSDP2),
so every layout's own loss (vocabulary-parallel, the grid's) runs unchanged on each slice. Each slice runs under
activation checkpointing: the forward keeps its loss and nothing of its logits; the backward computes the slice's
logits again, takes their gradient into the hidden states and the head's weight, and frees them before the next
slice. The price is the head's forward once more. The loss is the slices' means weighted by their share of the
targets: today's to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ChunkedLoss:
    """`loss_fn(head(hidden), targets)` computed `tokens` targets of the micro-batch at a time (whole positions of
    every sequence: at least one)."""

    def __init__(self, head: nn.Module, loss_fn: LossFn, tokens: int):
        self.head, self.loss_fn, self.tokens = head, loss_fn, tokens

    def _slice(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.head(hidden), targets)

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if isinstance(hidden, DTensor):  # sequence-parallel: gathered once, as the head would gather it
            hidden = hidden.redistribute(hidden.device_mesh, [Replicate()] * hidden.device_mesh.ndim)
        width = max(1, self.tokens // hidden.shape[0])
        if hidden.shape[1] <= width:
            return self._slice(hidden, targets)
        total, loss = targets.numel(), None
        for h, y in zip(hidden.split(width, dim=1), targets.split(width, dim=1), strict=True):
            part = checkpoint(self._slice, h, y, use_reentrant=False, preserve_rng_state=False) * (y.numel() / total)
            loss = part if loss is None else loss + part
        return loss


def chunked(parts: list[nn.Module], loss_fn: LossFn, tokens: int) -> LossFn:
    """Every part's model made to return its hidden states, and the loss that applies the head over slices; on
    the parts of a pipeline rank without the head (which never compute the loss), `loss_fn` as it was."""
    models = [part.module if isinstance(part, DistributedDataParallel) else part for part in parts]
    for model in models:
        if not hasattr(model, "head_skipped"):
            raise ValueError(
                f"trainer.loss_chunk={tokens}: {type(model).__name__} cannot leave its head to the loss (it has no "
                f"`head_skipped`, distrain/model/contract.py); set trainer.loss_chunk=0"
            )
        model.head_skipped = True
    name = models[0].output_modules[-1]
    heads = [getattr(model, name) for model in models if getattr(model, name, None) is not None]
    return ChunkedLoss(heads[0], loss_fn, tokens) if heads else loss_fn
