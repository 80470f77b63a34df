"""Join the torch.distributed process group from torchrun-style environment variables."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import time

import torch
import torch.distributed as dist


def init_from_env(timeout_s: float = 600.0) -> torch.device:
    """NCCL and the local GPU when CUDA is visible, gloo and the CPU otherwise. On GPUs gloo runs
    beside NCCL for tensors in CPU memory: CPU offload's gradient norm, and the trainer's per-step
    agreement on stopping, which must not wait on the GPU's queue.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, exactly as torchrun sets them,
    so the same code runs under Ray workers and under plain torchrun.
    """
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if ipaddress.ip_address(socket.gethostbyname(os.environ["MASTER_ADDR"])).is_loopback:
        # gloo binds to the address the hostname resolves to, which may be an external interface.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        if int(os.environ["RANK"]) > 0:
            wait_for_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout_s)
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return device


def wait_for_store(host: str, port: int, timeout_s: float) -> None:
    """Until rank 0's rendezvous store accepts connections (or timeout_s, for init_process_group to
    report). torch's store client, started before the server listens, tries again only after a
    backoff of 0.4 s and more: ranks of a restart, which all start within milliseconds, would wait
    that long whenever rank 0 is the last."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.005)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
