"""Data parallel with PyTorch's DistributedDataParallel."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distrain.parallel.strategy import Strategy, register


@register("ddp")
class DDPStrategy(Strategy):
    def apply(self, model: nn.Module) -> nn.Module:
        device = next(model.parameters()).device
        return DistributedDataParallel(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            process_group=self.mesh.get_group(),
            bucket_cap_mb=self.options.get("bucket_cap_mb", 25.0),
            gradient_as_bucket_view=True,
            forward_sync_buffers=False,  # the only buffers are constant rotary tables
        )

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync()
