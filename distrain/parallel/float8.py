"""Float8 training (trainer.float8): the model's nn.Linear modules that distrain/strategy/float8.py's rule picks
become torchao's Float8Linear, their matmuls in float8 with dynamic tensorwise or rowwise scales.

The first pass of parallelize.PASSES, as torchtitan converts before it parallelises: on the meta device, before
tensor parallelism lays the converted modules out (its usual styles: DTensor takes the float8 casts, whose scales
are the whole tensor's amax) and before FSDP2 shards them, which under tensorwise scaling without tensor
parallelism then all-gathers each weight already cast to float8 (half bf16's bytes) with one scale for all its
shards (strategy/float8.gathers_float8). On a GPU below compute
capability 8.9 the run is refused at once; on a CPU torchao emulates the float8 matmul.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from types import ModuleType

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distrain.parallel.passes import PassContext
from distrain.strategy.float8 import check_gpu, gathers_float8, kept

# What importing torchao logs that concerns no float8 training: its CUDA extensions (MX formats, cutlass kernels)
# unloadable under a CPU torch, and torch's deprecation of a registration it makes. The float8 path is Python over
# torch._scaled_mm.
QUIET_ON_IMPORT = ("torchao", "torch.utils._pytree")


def torchao_float8() -> ModuleType:
    """torchao.float8, imported with QUIET_ON_IMPORT's loggers at ERROR (their levels put back after)."""
    loggers = [logging.getLogger(name) for name in QUIET_ON_IMPORT]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
    return torchao.float8


def parallelize(model: nn.Module, on: PassContext) -> nn.Module:
    """Convert this part's nn.Linear modules that the rule picks, in place; nothing under trainer.float8=none."""
    if on.float8 == "none":
        return model
    if on.device.type == "cuda":  # a CPU emulates the float8 matmul
        check_gpu(torch.cuda.get_device_capability(on.device), torch.cuda.get_device_name(on.device))
    ao = torchao_float8()
    gather = gathers_float8(on.float8, on.cfg.zero, on.layout)
    config = dataclasses.replace(
        ao.Float8LinearConfig.from_recipe_name(on.float8),
        emulate=on.device.type != "cuda",
        enable_fsdp_float8_all_gather=gather,
    )
    outputs = tuple(getattr(model, "output_modules", ()))
    ao.convert_to_float8_training(
        model,
        config=config,
        module_filter_fn=lambda m, fqn: kept(fqn, m.in_features, m.out_features, outputs) is None,
    )
    return model


def unwrapped(t: torch.Tensor) -> torch.Tensor:
    """`t` as a checkpoint or a replica holds it: a weight FSDP2 all-gathers in float8 (its local piece torchao's
    WeightWithDynamicFloat8CastTensor, a wrapper around the high-precision piece, `_tensor`) as a DTensor of the
    piece it wraps, the same storage; any other tensor as it is. DCP's background stager copies each tensor's
    storage, which a wrapper has none of: it saved garbage, and a run resumed from it had a NaN loss at once."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")  # loaded only where float8 is in use
    local = t._local_tensor if isinstance(t, DTensor) else t
    if fsdp_utils is None or not isinstance(local, fsdp_utils.WeightWithDynamicFloat8CastTensor):
        return t
    if not isinstance(t, DTensor):
        return local._tensor
    return DTensor.from_local(
        local._tensor, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )
