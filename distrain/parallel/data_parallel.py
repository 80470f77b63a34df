"""Data parallelism at each ZeRO level, from PyTorch's own pieces.

zero 0: DDP (or, when the model already holds DTensors from TP or is a pipeline stage,
        FSDP2-based `replicate`, which composes with them)
zero 1: DDP; the optimizer shards its state (ZeroRedundancyOptimizer, train/optim.py; the experts' kept apart)
zero 2: FSDP2 `fully_shard`, parameters kept gathered from forward to backward
zero 3: FSDP2 `fully_shard`, parameters resharded after each block's forward
HSDP is zero 2/3 on a 2-D (dp_replicate, dp_shard) mesh; offload adds FSDP2's CPUOffloadPolicy.
The grid layouts of tensor parallelism (2-D, 2.5-D, 3-D) sum their gradients themselves (tpnd/grad_sync.py), and
expert parallelism its experts' (expert_parallel.py): DDP and FSDP2 leave those out.

It is the last pass of parallelize.PASSES: a model built on the meta device is materialised here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel

from distrain.compat import ddp_without_buffer_sync
from distrain.model.contract import owner, tie
from distrain.parallel.passes import PassContext


def parallelize(model: nn.Module, on: PassContext) -> nn.Module:
    """DDP where nothing else shards the model; FSDP2 for ZeRO-2/3; and for a replicated model
    that holds DTensors (TP) or is a pipeline stage, FSDP2's `replicate`, which composes with both;
    for the grid layouts nothing. A meta-built model is materialised after sharding, so that a rank
    allocates and initialises only its shards, and before replicating, as DDP and `replicate` need
    real parameters when they wrap a model."""
    c, mesh = on.cfg, on.mesh.gradient
    experts = {id(p) for p in on.experts.params()} if on.experts is not None else set()
    own = [p for p in model.parameters() if id(p) in experts]  # this part's: expert parallelism sums their gradients
    if on.grid is not None:  # gradients summed over the grid by GradSync (ParallelModel)
        materialize(model, on.device)
        return model
    if mesh is not None and c.zero >= 2:
        offload = c.offload != "none"  # nvme too: it moves only the optimizer state on from host memory
        shards = on.mesh.expert_shards
        if shards is not None:  # the experts sharded over ep_rest by units of their own, before the blocks'
            shard_experts(model, on, shards)
            own = []
        apply_fsdp(model, mesh, reshard_after_forward=c.zero == 3, bf16=on.bf16, offload=offload, ignored=set(own))
        materialize(model, on.device, offload=offload)
        return model
    ignored = [name for name, p in model.named_parameters() if id(p) in experts]
    materialize(model, on.device)
    if mesh is None:  # every worker is taken by tensor or pipeline parallelism
        return model
    if on.layout.tp == 1 and on.layout.pp == 1:
        return apply_ddp(model, mesh, c.bucket_cap_mb, ignored)
    return apply_replicate(model, mesh, on.bf16, set(own))


def materialize(model: nn.Module, device: torch.device, offload: bool = False) -> None:
    """Allocate a meta-built model's parameters and buffers (only this rank's shards of sharded ones)
    on `device` and fill them with the model's initial weights (`init_weights`). With `offload` the
    parameters go to CPU memory, where FSDP2's CPUOffloadPolicy keeps them, and only the buffers
    (the rotary tables) to `device`, where the model computes. A model that already holds real
    tensors is left as it is."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    model.to_empty(device=torch.device("cpu") if offload else device)
    tie(model)  # to_empty gave each module its own tensor
    model.init_weights()
    if offload:
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                setattr(module, name, buffer.to(device))


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, bucket_cap_mb: float, ignored: list[str]) -> nn.Module:
    """DDP over the gradient mesh, but for the parameters named in `ignored` (whose gradients are summed apart)."""
    device = next(model.parameters()).device
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return DistributedDataParallel(
        model,
        device_ids=[device] if device.type == "cuda" else None,
        process_group=dp_mesh.get_group(),
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=True,
        **ddp_without_buffer_sync(),
    )


def apply_replicate(
    model: nn.Module, dp_mesh: DeviceMesh, bf16: bool, ignored: set[nn.Parameter] | None = None
) -> nn.Module:
    """FSDP2's `replicate` over the gradient mesh, but for the `ignored` parameters (expert parallelism's experts
    beside tensor or pipeline parallelism: their gradients are summed apart)."""
    replicate(model, mesh=dp_mesh, mp_policy=mixed_precision(bf16), ignored_params=ignored or None)
    return model


def mixed_precision(bf16: bool) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 master weights and fp32 gradient reduction, or fp32 throughout.
    Inputs are not cast: the rotary tables a block receives stay fp32, as under DDP's autocast."""
    if bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return MixedPrecisionPolicy(cast_forward_inputs=False)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    reshard_after_forward: bool,
    bf16: bool,
    offload: bool,
    ignored: set[nn.Parameter] | None = None,
) -> None:
    """Shard each block, the model's input modules and its output modules (contract.py) as their own
    units, so that at most one block's parameters are gathered at a time and the root holds none of
    its own. Input and output modules sharing a tied parameter form one unit: a parameter belongs to one.
    The `ignored` parameters stay as they are (expert parallelism's experts)."""
    options = {
        "ignored_params": ignored or None,
        "mesh": dp_mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mixed_precision(bf16),
        # Pinned memory speeds up host-device copies; without a GPU there is none to pin for.
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy(),
    }
    for block in model.layers.values():
        fully_shard(block, **options)
    for unit in edge_units(model):
        fully_shard(unit, **options)
    fully_shard(model, **options)


def shard_experts(model: nn.Module, on: PassContext, shards: DeviceMesh) -> None:
    """Each of this part's expert modules an FSDP2 unit over `shards` (ep_rest: ZeRO-2/3 of the experts that expert
    parallelism leaves whole on a rank), their Shard(0) over `ep` joined to FSDP2's dim as FSDP with TP is. FSDP2
    shards their dim 1 (the expert's rows), as dim 0 is ep's: no strided sharding, no padding of few experts.
    It divides their summed gradient by the whole gradient group's width, not ep_rest's: an expert's gradient
    already sums what every rank of its ep group sent it, so this is the mean the other weights get."""
    held = {id(m) for m in model.modules()}
    for experts in (m for m in on.experts.modules if id(m) in held):
        fully_shard(
            experts,
            mesh=shards,
            reshard_after_forward=on.cfg.zero == 3,
            mp_policy=mixed_precision(on.bf16),
            shard_placement_fn=lambda _: Shard(1),
        )
        experts.set_gradient_divide_factor(float(on.layout.gradient_width))
        experts.set_force_sum_reduction_for_comms(True)  # sum, then divide: gloo has no PREMUL_SUM


def edge_units(model: nn.Module) -> list[list[nn.Module]]:
    """The FSDP units of the modules before and after the blocks that this stage holds; one unit
    when a tied parameter joins an input module to an output module."""
    inputs = [n for n in model.input_modules if getattr(model, n) is not None]
    outputs = [n for n in model.output_modules if getattr(model, n) is not None]
    owners = [{owner(a), owner(b)} for a, b in model.tied_parameters]
    joined = any(o & set(inputs) and o & set(outputs) for o in owners)
    units = [inputs + outputs] if joined else [inputs, outputs]
    return [[getattr(model, n) for n in unit] for unit in units if unit]


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate this micro-batch's gradients locally: DDP's no_sync, FSDP2's requires_gradient_sync."""
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
        return
    assert isinstance(model, FSDPModule), f"no data-parallel wrapper on {type(model).__name__}"
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
