"""What each parallelize pass (parallelize.PASSES) is given: the rank's mesh (its layout and device
meshes), and what an earlier pass leaves for the later ones (the grid of 2-D/2.5-D/3-D tensor
parallelism, whose gradients data parallelism must then leave alone; context parallelism's split of the
sequence; expert parallelism's experts, whose gradients it sums itself). A module of its own, so that the
passes need not import the ParallelModel that runs them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from distrain.config import StrategyConfig
from distrain.parallel.mesh import ParallelMesh
from distrain.parallel.sequence_split import SequenceSplit
from distrain.parallel.tpnd.grid import Grid
from distrain.strategy.layout import Layout

if TYPE_CHECKING:
    from distrain.parallel.expert_parallel import ExpertGradients


@dataclass
class PassContext:
    cfg: StrategyConfig
    mesh: ParallelMesh
    device: torch.device
    bf16: bool
    vocab_sharded_loss: bool  # 1-D tensor parallelism's loss on vocabulary-sharded logits
    float8: str = "none"  # trainer.float8: the recipe the first pass converts the model's nn.Linear modules with
    grid: Grid | None = None  # set by tensor parallelism's pass on the grid layouts
    sequence_split: SequenceSplit | None = None  # set by context parallelism's pass: each rank's tokens
    experts: ExpertGradients | None = None  # set by expert parallelism's pass: data parallelism leaves them out

    @property
    def layout(self) -> Layout:
        return self.mesh.layout


Pass = Callable[[nn.Module, PassContext], nn.Module]
