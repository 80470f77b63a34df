"""What each parallelism's step (parallelize.STEPS) is given: one rank's place in the layout, and what
an earlier step leaves for the later ones (the grid of 2-D/2.5-D/3-D tensor parallelism, whose
gradients data parallelism must then leave alone; context parallelism's split of the sequence). A module
of its own, so that the steps need not import the ParallelModel that runs them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from distrain.config import StrategyConfig
from distrain.parallel.tpnd.grid import Grid
from distrain.strategy.layout import Layout

if TYPE_CHECKING:
    from distrain.parallel.context_parallel import SequenceSplit


@dataclass
class StepContext:
    cfg: StrategyConfig
    layout: Layout
    mesh: DeviceMesh | None  # None without a process group (a parameter-server worker)
    dp_mesh: DeviceMesh | None  # the data-parallel dims of the mesh; None where there are none
    device: torch.device
    bf16: bool
    vocab_sharded_loss: bool  # 1-D tensor parallelism's loss on vocabulary-sharded logits
    grid: Grid | None = None  # set by tensor parallelism's step on the grid layouts
    sequence_split: SequenceSplit | None = None  # set by context parallelism's step: each rank's tokens


Step = Callable[[nn.Module, StepContext], nn.Module]
