"""Throughput, model FLOPs utilisation and memory of one rank."""

from __future__ import annotations

import resource

import torch

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


def peak_flops(device: torch.device, precision: str) -> float | None:
    if device.type != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_FLOPS.items() if key in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on a GPU; peak resident memory of the process on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
