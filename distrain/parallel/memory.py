"""What a rank actually holds: bytes of parameters, gradients and optimizer state, counted from
the tensors themselves (a DTensor counts its local shard), so ZeRO's claims can be checked."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], None]) -> dict[str, int]:
    """Run `step()` (one forward, backward and optimizer step) and count, per rank: parameters as
    held when the forward pass ends (gathered ones count in full: ZeRO-2 keeps them until the
    backward, ZeRO-3 has already freed them), gradients after the backward, and the optimizer's
    state after its step (per-parameter tensors, not the scalar step counters)."""
    seen: dict[str, int] = {}

    def after_forward(*_: object) -> None:
        seen["params"] = local_bytes(module.parameters())

    def before_step(*_: object) -> None:
        seen["grads"] = local_bytes(p.grad for p in module.parameters() if p.grad is not None)

    forward = module.register_forward_hook(after_forward)
    pre_step = optimizer.register_step_pre_hook(before_step)
    try:
        step()
    finally:
        forward.remove()
        pre_step.remove()
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.ndim > 0]
    seen["optimizer"] = local_bytes(states)
    return seen
