"""What a benchmark ran on, for the header of its page: CPU, cores, GPUs, versions, load."""

from __future__ import annotations

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
