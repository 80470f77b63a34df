"""What a Ray cluster has for workers, asked of it, and what an embedded one would have, counted before it
starts: CPUs, GPUs, memory (the memory check's capacity, distrain/driver/fits.py)."""

from __future__ import annotations

import os
import subprocess

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distrain.config import attach_address


def embedded_resources(address: str | None, num_cpus: int | None, num_gpus: int | None) -> dict[str, float] | None:
    """The resources of the embedded cluster `connect(address, num_cpus, num_gpus)` would start now, counted
    before it starts as Ray counts them: CPUs and GPUs (the given numbers, else the machine's: Ray's CPU count,
    which honours a container's quota; the GPUs nvidia-smi lists, as many as CUDA_VISIBLE_DEVICES names), and
    `memory`, what it gives its workers (its `memory` and `object_store_memory` are cut from Ray's estimate of
    the memory free now). None when it would start none: it attaches, or this process has a cluster up."""
    from ray._private.utils import estimate_available_memory, get_num_cpus

    if ray.is_initialized() or attach_address(address):
        return None
    gpus = num_gpus
    if gpus is None:
        gpus = len(gpu_mib(nvidia_smi()))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            gpus = min(gpus, len([d for d in visible.split(",") if d.strip()]))
    cpus = get_num_cpus() if num_cpus is None else num_cpus
    return {"CPU": cpus, "GPU": gpus, "memory": estimate_available_memory()}


def node_memory() -> tuple[int, str]:
    """The largest alive node's memory for workers, in bytes, and the node's address: what Ray gives its
    tasks and object store there (`memory` + `object_store_memory`, about the node's RAM less what is in use)."""
    best = max(
        (
            (n["Resources"].get("memory", 0) + n["Resources"].get("object_store_memory", 0), n["NodeManagerAddress"])
            for n in ray.nodes()
            if n["Alive"]
        ),
        default=(0, "none"),
    )
    return int(best[0]), best[1]


def gpu_memory(timeout_s: float = 30.0) -> tuple[int, str] | None:
    """The smallest GPU's memory in bytes over the alive GPU nodes, and its node, as `nvidia-smi` reports it
    there; None when it cannot tell in timeout_s. A CPU-less task pinned to each node asks: it takes no
    GPU (busy GPUs do not make it wait) and imports nothing (torch would cost seconds at every start)."""
    nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0]
    refs = {
        _total_gpu_mib.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(): n["NodeManagerAddress"]
        for n in nodes
    }
    try:
        answers = ray.get(list(refs), timeout=timeout_s)
    except (GetTimeoutError, RayError):
        return None
    sizes = [(mib * 2**20, node) for mib, node in zip(answers, refs.values(), strict=True) if mib]
    return min(sizes) if sizes and len(sizes) == len(refs) else None


@ray.remote(max_retries=0)
def _total_gpu_mib() -> int | None:
    return smallest_mib(nvidia_smi())


NVIDIA_SMI = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]


def nvidia_smi() -> str:
    """What nvidia-smi says of this machine's GPUs' memory; nothing without nvidia-smi, or when it hung."""
    try:
        return subprocess.run(NVIDIA_SMI, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def gpu_mib(output: str) -> list[int]:
    """nvidia-smi's memory.total column (MiB, a line per GPU) → each GPU's."""
    return [int(line) for line in output.split() if line.isdigit()]


def smallest_mib(output: str) -> int | None:
    """nvidia-smi's memory.total column → the smallest GPU's, or None if it printed none."""
    return min(gpu_mib(output), default=None)
