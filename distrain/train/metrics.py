"""Throughput, model FLOPs utilisation and memory of one rank, and reading device scalars without a stall."""

from __future__ import annotations

import resource
from pathlib import Path

import torch
import torch.distributed as dist

# Dense bf16 tensor-core peaks (FLOP/s) of the devices whose figure is published; MFU is reported
# only for these, and only when training in bf16.
# The first name that the device's name contains wins, so variants come before their family.
BF16_PEAK_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
}
_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def peak_flops(device: torch.device, precision: str) -> float | None:
    if device.type != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_FLOPS.items() if key in name), None)


def memory_peaks(device: torch.device, reset: bool = False) -> dict[str, int]:
    """Peak memory since the last reset: on a GPU, allocated and reserved (what the caching allocator
    holds, the figure that must fit on the device); on a CPU, the process's resident memory (VmHWM, which
    Linux resets through clear_refs; the lifetime peak where it cannot). `reset` starts the next window."""
    if device.type == "cuda":
        peaks = {
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return peaks
    try:
        kib = next(int(line.split()[1]) for line in _STATUS.read_text().splitlines() if line.startswith("VmHWM:"))
        if reset:
            _CLEAR_REFS.write_text("5")
    except (OSError, StopIteration):
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_memory_bytes": kib * 1024}


class Readback:
    """Scalars of a step read on the host later, without waiting for the work queued after them: the
    loss summed over the ranks and the gradient norm, read once the next step has been queued. On a GPU
    the all-reduce is stream-ordered (NCCL) and the copy into host memory does not block, an event marks
    its end; on a CPU the all-reduce (gloo) runs as asynchronous work, waited for when read."""

    def __init__(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor, more: torch.Tensor | None = None):
        """`more`: further figures of the step, already summed over the ranks (the experts' loads), read with them."""
        total = loss_sum.detach().float().clone()
        norm = grad_norm.detach().float().to(total.device)  # on the CPU under CPU offload
        rest = [] if more is None else [more.detach().float().flatten().to(total.device)]
        if total.is_cuda:
            dist.all_reduce(total)
            self.values = torch.cat([total[None], norm[None], *rest]).to("cpu", non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.values = torch.cat([total[None], norm[None], *rest])
            self.done = dist.all_reduce(self.values[:1], async_op=True)

    def ready(self) -> bool:
        """Whether `read` would return without waiting (after a failure: never wait on a dead peer)."""
        return self.done.query() if isinstance(self.done, torch.cuda.Event) else self.done.is_completed()

    def read(self) -> tuple[float, float, list[float]]:
        """(the loss summed over the ranks, the gradient norm, the further figures)."""
        if isinstance(self.done, torch.cuda.Event):
            self.done.synchronize()
        else:
            self.done.wait()
        loss, norm, *more = self.values.tolist()
        return loss, norm, more
