"""What a benchmark ran on, for the header of its page: CPU, cores, GPUs, versions, load; and
whether its runs stayed on loopback."""

from __future__ import annotations

import ipaddress
import os
import platform
from importlib.metadata import version
from pathlib import Path


def machine() -> dict:
    """The load average is taken now: other work on the machine skews CPU numbers most."""
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "ray": version("ray"),
        "python": platform.python_version(),
        "load": os.getloadavg()[0],
    }
    if torch.cuda.is_available():
        info["gpu"] = f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}"
        info["cuda"] = torch.version.cuda
    return info


def describe(info: dict) -> str:
    """The machine in one line for a page's header: CPU, cores, GPUs; torch, ray and Python versions."""
    return (
        f"{info['cpu']}, {info['cores']} cores, {info.get('gpu') or 'no GPU'}; "
        f"torch {info['torch']}, ray {info['ray']}, Python {info['python']}"
    )


def off_loopback(placement: list[dict]) -> list[str]:
    """The addresses in a run's placement.json that are not loopback: benchmarks send nothing off the machine."""
    return sorted(
        {p["node_ip"] for p in placement if "node_ip" in p and not ipaddress.ip_address(p["node_ip"]).is_loopback}
    )
