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
from distrain.model.moe import Experts, grouped_linear, local

ADAPTERS = ("lora_A", "lora_B")
EXPERT_WEIGHTS = ("w1", "w2", "w3")  # a routed experts module's stacked weights (model/moe.py's Experts)


def is_adapter(name: str) -> bool:
    """Whether parameter `name` (a full-model name) is an adapter's: a layer's `lora_A`, or an expert weight's
    (`experts.w1_lora_A`)."""
    return name.endswith(ADAPTERS)


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

    def deltas(self) -> dict[str, torch.Tensor]:
        """What the adapter adds to the weight (whole tensors): the merge of `jobs/export.py merge=true`."""
        return {"weight": (self.lora_B @ self.lora_A) * self.scale}


class LoRAExperts(Experts):
    """A mixture of experts' routed experts with an adapter per expert on each of w1, w2 and w3, beside the frozen
    stacked weight: `w1_lora_A` (experts, rank, in) and `w1_lora_B` (experts, out, rank). They sit on the module
    itself, so expert parallelism, FSDP and tensor parallelism place them as they place its weights (dim 0: the
    experts). Each expert's rows take the low-rank path apart (no merged weight is built), so dropout applies."""

    def __init__(self, base: Experts, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)
        for name in EXPERT_WEIGHTS:
            w = getattr(base, name)
            num, out, fan_in = w.shape
            self.register_parameter(name, nn.Parameter(w.data, requires_grad=False))
            with torch.device(w.device):
                setattr(self, f"{name}_lora_A", nn.Parameter(torch.empty(num, rank, fan_in)))
                setattr(self, f"{name}_lora_B", nn.Parameter(torch.empty(num, out, rank)))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def project(self, name: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        a, b = (local(p).to(x.dtype) for p in self.pair(name))
        adapted = grouped_linear(grouped_linear(self.dropout(x), a, counts), b, counts)
        return super().project(name, x, counts) + adapted * self.scale

    def deltas(self) -> dict[str, torch.Tensor]:
        """What the adapters add to w1, w2 and w3, every expert's (whole tensors): (experts, out, in) each."""
        return {w: torch.bmm(*self.pair(w)[::-1]) * self.scale for w in EXPERT_WEIGHTS}

    def pair(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Weight `name`'s adapters (A, B): (experts, rank, in) and (experts, out, rank)."""
        return getattr(self, f"{name}_lora_A"), getattr(self, f"{name}_lora_B")


def add_adapters(model: nn.Module, cfg: LoRAConfig, seed: int) -> nn.Module:
    """`model` with adapters on the `nn.Linear`s `cfg.targets` names and every other parameter frozen (as it is when
    cfg.rank is 0: no adapters); a one-line ConfigError when none is named. Built on the meta device the adapters are
    drawn by `init_weights`, else here."""
    if cfg.rank == 0:
        return model
    chosen = [(n, m) for n, m in model.named_modules() if _adaptable(n, m, cfg)]
    if not chosen:
        raise ConfigError(
            f"finetune.lora.targets={list(cfg.targets)}: no nn.Linear or routed experts of the model's blocks match "
            f"(layers.<i>.attention.<w>, layers.<i>.feed_forward.<w>, layers.<i>.feed_forward.experts); see "
            f"docs/huggingface.md"
        )
    for name, module in chosen:
        parent, _, attr = name.rpartition(".")
        kind = LoRALinear if isinstance(module, nn.Linear) else LoRAExperts
        setattr(model.get_submodule(parent), attr, kind(module, cfg.rank, cfg.alpha, cfg.dropout))
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


def _adaptable(name: str, module: nn.Module, cfg: LoRAConfig) -> bool:
    return type(module) in (nn.Linear, Experts) and cfg.adapts(name)


def adapter_value(seed: int, name: str, shape: torch.Size) -> torch.Tensor:
    """An adapter's first value, whole: B zero; A Kaiming-uniform with a=√5 (bound 1/√in, as nn.Linear and PEFT; an
    expert's A drawn as the (experts · rank, in) matrix PEFT holds for them) from a generator seeded by (seed, name)."""
    if name.endswith("lora_B"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    rows = torch.empty(math.prod(shape[:-1]), shape[-1])
    return nn.init.kaiming_uniform_(rows, a=math.sqrt(5), generator=generator).view(shape)


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


def adapted(model: nn.Module) -> list[tuple[str, LoRALinear | LoRAExperts]]:
    """The model's adapted layers and experts, by name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear | LoRAExperts)]
