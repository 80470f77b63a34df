"""Pipeline parallelism with `torch.distributed.pipelining`: split by layer, schedule micro-batches.

Each stage is the full model with the blocks, input and output modules (distrain/model/contract.py) it
does not own removed, so every remaining parameter keeps its name: checkpoints move between pipeline
layouts unchanged. A parameter tied across the first and last stages is a copy on each
(ParallelModel sums their gradients).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)

from distrain.strategy.layout import Layout
from distrain.strategy.pipeline import SCHEDULES, stage_layers

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The classes behind the names of distrain/strategy/pipeline.py's SCHEDULES (a test checks that the two match).
SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
}


def split_stages(model: nn.Module, pp_mesh: DeviceMesh, layout: Layout) -> dict[int, nn.Module]:
    """This rank's stages, stage index → module; `model` itself becomes the last of them."""
    n_stages = layout.num_stages
    layers = stage_layers(len(model.layers), n_stages)
    mine = layout.stages(pp_mesh.get_local_rank())
    _keep_layers(model, {i for index in mine for i in layers[index]})  # before copying: copy only this rank's blocks
    stages = {}
    for n, index in enumerate(mine):
        stage = model if n == len(mine) - 1 else copy.deepcopy(model)
        _keep_layers(stage, set(layers[index]))
        for name in stage.input_modules if index != 0 else ():
            setattr(stage, name, None)
        for name in stage.output_modules if index != n_stages - 1 else ():
            setattr(stage, name, None)
        stages[index] = stage
    return stages


def _keep_layers(model: nn.Module, keep: set[int]) -> None:
    for name in [name for name in model.layers if int(name) not in keep]:
        del model.layers[name]


class Pipeline:
    """This rank's stages and the schedule that drives one step's micro-batches through them."""

    def __init__(
        self,
        stages: dict[int, nn.Module],
        pp_mesh: DeviceMesh,
        device: torch.device,
        layout: Layout,
        loss_fn: LossFn,
    ):
        group, n_stages = pp_mesh.get_group(), layout.num_stages
        self.stages = [PipelineStage(m, i, n_stages, device, group=group) for i, m in stages.items()]
        self.has_first = 0 in stages
        self.has_last = n_stages - 1 in stages
        cls = SCHEDULE_CLASSES[layout.schedule]
        multi = SCHEDULES[layout.schedule].multi_stage
        # scale_grads (the default): the gradient is the mean over the micro-batches, as without a pipeline.
        self.schedule = cls(self.stages if multi else self.stages[0], layout.micro_batches, loss_fn=loss_fn)

    def step(self, x: torch.Tensor, y: torch.Tensor, train: bool = True) -> list[torch.Tensor]:
        """Run the local batch through the pipeline (forward and backward when training); the
        micro-batch losses on the rank holding the last stage, an empty list elsewhere."""
        losses: list[torch.Tensor] = []
        args = (x.contiguous(),) if self.has_first else ()  # torch 2.11 checks its strides against a contiguous one's
        kwargs = {"target": y, "losses": losses} if self.has_last else {}
        (self.schedule.step if train else self.schedule.eval)(*args, **kwargs)
        return losses
