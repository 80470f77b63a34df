"""The model contract: what every strategy in distrain/parallel/ relies on, and nothing more.

A model is built by its `_target_` (a class or function) called `(cfg: ModelConfig, max_seq_len: int,
seed: int)`, under `with torch.device("meta")` (it allocates nothing there), and provides:

- `init_weights()`: every parameter (and buffer) filled from `seed` and the parameter's full-model name
  alone, so the weights are the same under every layout; a sharded (DTensor) parameter keeps only its
  piece (`fill_parameters` does both). Called after the layout placed the model (`to_empty` first); a
  model built off the meta device calls it itself (the parameter server builds one so).
- `layers`: an `nn.ModuleDict` of the blocks in order, keyed "0".."n-1": pipeline splits, activation
  checkpointing, FSDP units and compilation work block by block.
- `input_modules` / `output_modules`: names of the top-level modules run before / after the blocks,
  which go with the first / last pipeline stage and form FSDP units. `forward` skips those set to None
  (a stage without them receives and returns hidden states) and runs `layers.values()` in order.
- `tied_parameters`: (alias, source) full-model names of parameters that are one tensor (e.g.
  ("output.weight", "tok_embeddings.weight")); empty when none.
- `tp_plan(loss_parallel: bool) -> dict[str, ParallelStyle] | None`: 1-D tensor parallelism for
  `parallelize_module` over the parts present; `grid_tp_plan() -> dict[str, str] | None`: each weight's
  role for 2-D/2.5-D/3-D tensor parallelism. None: no such plan (the driver refuses that strategy).
- `flops_per_token(seq_len: int) -> float`: training FLOPs per token; the parameter count is counted.

The chunked loss (trainer.loss_chunk) asks one thing more: an attribute `head_skipped`, which the step sets, and
while it is true `forward` returns the hidden states the head (the last of `output_modules`) would take, without
applying it (`common.FamilyModel.head`); the loss then calls the head itself, a slice of the sequence at a time.

Context parallelism (strategy.cp) asks two things more: the causal attention computed by a
`common.CausalAttention` module (the step swaps each for one that sees the whole sequence), and the tokens'
positions read from the model's `sequence_split`, which the step sets (`common.FamilyModel.positions`):
under cp a rank holds a load-balanced share of each sequence, not its first tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

# Each part of the contract and what it is, for the one-line error naming a missing one.
METHODS = ("init_weights", "tp_plan", "grid_tp_plan", "flops_per_token")
ATTRIBUTES = ("input_modules", "output_modules", "tied_parameters")


def missing_part(model: nn.Module) -> str | None:
    """The first part of the contract `model` lacks, in words; None when it keeps all of it."""
    if not isinstance(model, nn.Module):
        return f"it returned a {type(model).__name__}, not a torch.nn.Module"
    if not isinstance(getattr(model, "layers", None), nn.ModuleDict):
        return "`layers` (an nn.ModuleDict of the blocks keyed '0'..'n-1')"
    if list(model.layers) != [str(i) for i in range(len(model.layers))]:
        return f"`layers` keyed '0'..'{len(model.layers) - 1}' in order (has {list(model.layers)[:4]}...)"
    for name in METHODS:
        if not callable(getattr(model, name, None)):
            return f"the method `{name}`"
    for name in ATTRIBUTES:
        if not hasattr(model, name):
            return f"the attribute `{name}`"
    for name in (*model.input_modules, *model.output_modules):
        if not isinstance(getattr(model, name, None), nn.Module):
            return f"the module `{name}` its input_modules/output_modules name"
    return None


def canonical(model: nn.Module, name: str) -> str:
    """A tied parameter's name as its source's: the value both share."""
    return dict(model.tied_parameters).get(name, name)


def tie(model: nn.Module) -> None:
    """Make each tied pair one parameter again where the model holds both owners: `to_empty`,
    `parallelize_module` and a pipeline split replace parameters module by module. A pipeline stage
    holding only one of them keeps its own copy (ParallelModel sums the copies' gradients)."""
    for alias, source in model.tied_parameters:
        alias_owner, _, alias_attr = alias.rpartition(".")
        source_owner, _, source_attr = source.rpartition(".")
        if _present(model, alias_owner) and _present(model, source_owner):
            setattr(
                model.get_submodule(alias_owner), alias_attr, getattr(model.get_submodule(source_owner), source_attr)
            )


def _present(model: nn.Module, owner: str) -> bool:
    try:
        return model.get_submodule(owner) is not None
    except AttributeError:
        return False


def owner(name: str) -> str:
    """The top-level module holding parameter `name`."""
    return name.split(".", 1)[0]


@torch.no_grad()
def fill_parameters(
    module: nn.Module,
    value_of: Callable[[str, torch.Size], torch.Tensor],
    only: Callable[[str], bool] = lambda name: True,
) -> None:
    """Copy each parameter's FULL value, `value_of(full-model name, full shape)`, into it: a plain
    parameter whole, a DTensor (FSDP2, TP) only its local piece (cut here, no communication). A
    DDP "module." prefix is stripped; a tied parameter is filled once, by its source's name. `only`: the
    names filled (LoRA's adapters, or all but them)."""
    model = module.module if isinstance(module, DistributedDataParallel) else module
    for name, p in ((n, p) for n, p in model.named_parameters() if only(n)):
        full = value_of(canonical(model, name) if hasattr(model, "tied_parameters") else name, p.shape)
        if isinstance(p, DTensor):
            piece = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(piece)
        else:
            p.copy_(full)
