"""The mixture-of-experts layers of one rank's stages, once per training step (distrain/model/moe.py): their
figures summed over the ranks holding the same layers and different tokens (the gradient group: data
parallelism with cp), the loss-free bias moved by the whole batch's load, the same on every such rank, and
the step's figures named for its log line."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from distrain.model.moe import FIGURES, MoE
from distrain.parallel.mesh import ParallelMesh


class Routers:
    """Made from the whole model before a pipeline splits it (`blocks`: its blocks with experts, in order); `hold`
    then takes the layers of this rank's stages."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, device: torch.device):
        whole = layers_of([model])
        self.blocks = sorted(whole)
        self.width = next(iter(whole.values())).m.num_experts + len(FIGURES) if whole else 0
        self.device = device
        self.layers: dict[int, MoE] = {}
        gradient = mesh.gradient  # 2-D under HSDP: a sum over each of its dims in turn is the sum over all
        self.groups = gradient.get_all_groups() if gradient is not None else []
        self.stages = mesh.group("pp") if mesh.layout.pp > 1 else None

    def hold(self, parts: list[nn.Module]) -> None:
        self.layers = layers_of(parts)

    def begin(self) -> None:
        """A training step's forwards start counting afresh."""
        for layer in self.layers.values():
            layer.figures = None

    def end(self) -> torch.Tensor | None:
        """After a training step's backward: each expert block's figures over the whole batch (a row per block of
        the whole model, whichever stage holds it; None without experts), and each bias moved by its layer's load."""
        if not self.blocks:
            return None
        figures = torch.zeros(len(self.blocks), self.width, device=self.device)
        for block, layer in self.layers.items():
            figures[self.blocks.index(block)] = layer.figures
        for group in self.groups:
            dist.all_reduce(figures, group=group)
        for block, layer in self.layers.items():
            layer.balance(figures[self.blocks.index(block), : -len(FIGURES)])
        if self.stages is not None:  # each stage's rows to every stage (the others hold zeros there)
            dist.all_reduce(figures, group=self.stages)
        return figures

    def describe(self, values: list[float]) -> dict[str, float]:
        """A step's figures (`end`'s, flattened, on the host) as metrics: the mean balance loss and z-loss per
        forward of a layer, each layer's load imbalance (its busiest expert's tokens ÷ the mean), and the token
        copies dropped over capacity, if any were."""
        rows = [values[i * self.width : (i + 1) * self.width] for i in range(len(self.blocks))]
        named = [dict(zip(FIGURES, row[-len(FIGURES) :], strict=True)) for row in rows]
        metrics = {
            "moe_balance_loss": sum(f["balance_loss"] / f["forwards"] for f in named) / len(named),
            "moe_z_loss": sum(f["z_loss"] / f["forwards"] for f in named) / len(named),
        }
        for block, row in zip(self.blocks, rows, strict=True):
            load = row[: -len(FIGURES)]
            metrics[f"moe_imbalance_{block}"] = max(load) / (sum(load) / len(load))
        dropped = sum(f["dropped"] for f in named)
        if dropped:
            metrics["moe_dropped"] = dropped
        return metrics


def layers_of(parts: list[nn.Module]) -> dict[int, MoE]:
    """The MoE layers of `parts`, by block."""
    return {block_of(name): m for part in parts for name, m in part.named_modules() if isinstance(m, MoE)}


def block_of(name: str) -> int:
    """The block index in a module's name (`layers.3.feed_forward`, under any wrapper's prefix)."""
    return int(name.split("layers.", 1)[1].split(".", 1)[0])
