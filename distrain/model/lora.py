"""Low-rank adapters (LoRA, Hu et al. 2021) on a model keeping the contract (contract.py), as `finetune.lora` asks.

`add_adapters` turns each targeted `nn.Linear` of the blocks into a `LoRALinear`: the same module with its weight
and bias frozen and two trained matrices beside them, `lora_A` (rank, in) and `lora_B` (out, rank), so that every
base parameter keeps its name (Hugging Face import and export, checkpoints, the tensor-parallel plans) and the
adapters are named after it (`layers.0.attention.wq.lora_A`). A is drawn as PEFT draws it (Kaiming-uniform, a=√5;
from the run's seed and the adapter's name, so alike under every layout), B is zero: the adapted model starts as
the base. The model's `init_weights` and `tp_plan` are wrapped on the instance, so a user's model gets them too:
under 1-D tensor parallelism an adapter splits as its base layer does (`LoRAColwise`, `LoRARowwise`), which keeps
the base layer's one collective. Checkpoints hold the adapters alone (train/state.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from distrain.config import ConfigError, LoRAConfig
from distrain.model.common import parameter_seed
from distrain.model.contract import fill_parameters

ADAPTERS = ("lora_A", "lora_B")


def is_adapter(name: str) -> bool:
    """Whether parameter `name` (a full-model name) is an adapter's."""
    return name.rsplit(".", 1)[-1] in ADAPTERS


class LoRALinear(nn.Linear):
    """y = x Wᵀ + b + dropout(x) Aᵀ Bᵀ · alpha/rank, W and b frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        with torch.device(base.weight.device):
            super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
            self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
            self.lora_B = nn.Parameter(torch.empty(base.out_features, rank))
        self.weight = nn.Parameter(base.weight.data, requires_grad=False)
        if base.bias is not None:
            self.bias = nn.Parameter(base.bias.data, requires_grad=False)
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapted = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + adapted * self.scale

    def delta(self) -> torch.Tensor:
        """What the adapter adds to the weight (whole tensors): the merge of `jobs/export.py merge=true`."""
        return (self.lora_B @ self.lora_A) * self.scale


def add_adapters(model: nn.Module, cfg: LoRAConfig, seed: int) -> nn.Module:
    """`model` with adapters on the `nn.Linear`s `cfg.targets` names and every other parameter frozen (as it is when
    cfg.rank is 0: no adapters); a one-line ConfigError when none is named. Built on the meta device the adapters are
    drawn by `init_weights`, else here."""
    if cfg.rank == 0:
        return model
    chosen = [n for n, m in model.named_modules() if type(m) is nn.Linear and cfg.adapts(n)]
    if not chosen:
        raise ConfigError(
            f"finetune.lora.targets={list(cfg.targets)}: no nn.Linear of the model's blocks matches "
            f"(layers.<i>.attention.<w> or layers.<i>.feed_forward.<w>); see docs/huggingface.md"
        )
    for name in chosen:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, attr, LoRALinear(getattr(owner, attr), cfg.rank, cfg.alpha, cfg.dropout))
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    base_init, base_plan = model.init_weights, model.tp_plan

    def init_weights() -> None:
        base_init()
        init_adapters(model, seed)

    def tp_plan(loss_parallel: bool) -> dict[str, ParallelStyle] | None:
        plan = base_plan(loss_parallel)
        return None if plan is None else {k: adapted_style(model, k, s) for k, s in plan.items()}

    model.init_weights, model.tp_plan = init_weights, tp_plan
    model.grid_tp_plan = lambda: None  # the grid layers have no adapters (validation refuses the layout)
    if not next(model.parameters()).is_meta:
        init_adapters(model, seed)
    return model


def adapter_value(seed: int, name: str, shape: torch.Size) -> torch.Tensor:
    """An adapter's first value, whole: B zero; A Kaiming-uniform with a=√5 (bound 1/√in, as nn.Linear and PEFT)
    from a generator seeded by (seed, name)."""
    if name.endswith("lora_B"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=generator)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    fill_parameters(model, lambda name, shape: adapter_value(seed, name, shape), only=is_adapter)


class LoRAColwise(ColwiseParallel):
    """ColwiseParallel of a LoRALinear: W, b and B split by output row; A whole (it reads the whole input)."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh) -> None:  # noqa: ANN001
        _place(module, device_mesh, {"lora_A": Replicate()}, Shard(0), self.src_data_rank)


class LoRARowwise(RowwiseParallel):
    """RowwiseParallel of a LoRALinear: W and A split by input column (both read this rank's share of the input,
    both partial sums, reduced by the base layer's one collective); b and B whole."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh) -> None:  # noqa: ANN001
        _place(module, device_mesh, {"bias": Replicate(), "lora_B": Replicate()}, Shard(1), self.src_data_rank)


def _place(module: nn.Module, mesh, placements: dict, rest, src_data_rank: int | None) -> None:  # noqa: ANN001
    for key, p in list(module.named_parameters(recurse=False)):
        whole = distribute_tensor(p, mesh, [placements.get(key, rest)], src_data_rank=src_data_rank)
        module.register_parameter(key, nn.Parameter(whole, requires_grad=p.requires_grad))


def adapted_style(model: nn.Module, name: str, style: ParallelStyle) -> ParallelStyle:
    """The style of module `name` in the model's plan, its adapter's counterpart where it has one."""
    if not isinstance(model.get_submodule(name), LoRALinear):
        return style
    kind = {ColwiseParallel: LoRAColwise, RowwiseParallel: LoRARowwise}.get(type(style))
    if kind is None:
        raise ValueError(f"{name}: an adapter has no tensor-parallel split beside {type(style).__name__}")
    return kind(
        input_layouts=style.input_layouts[0],
        output_layouts=style.output_layouts[0],
        use_local_output=style.use_local_output,
    )


def adapted(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """The model's adapted layers, by name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
