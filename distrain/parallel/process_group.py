"""Join the torch.distributed process group from torchrun-style environment variables; set its timeouts,
abort it, and check that the process can still use its device after a failure."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

# Held while a group is made, aborted or destroyed: an abort comes on another thread (the supervisor's,
# through the worker) while the rank's own thread may be leaving a collective that abort just freed.
_lock = threading.Lock()
_formed = False  # whether the current default group is one init_from_env formed
# The groups `abort` and `destroy` ended, held until `release`: whatever holds one after them (a DDP
# reducer) must not be the last to let it go. Freed from Python, a group's destructor lets go of the GIL;
# freed by a reducer's, it keeps the GIL while it joins gloo's threads, and a thread that needs the GIL to
# drop the tensors of the work it has just finished never ends: the rank hangs.
_ended: list[dist.ProcessGroup] = []


class GpuUnavailableError(RuntimeError):
    """The rank was given a GPU, but this process's torch cannot use CUDA."""

    permanent = True  # the same on every attempt: the supervisor gives up at once instead of retrying


def device_for(gpu: bool | None) -> torch.device:
    """The rank's device: its GPU (LOCAL_RANK) when `gpu`, or when None (torchrun) and CUDA is visible;
    else the CPU. GpuUnavailableError, in one line naming the host, when a GPU was given and torch cannot
    use it (a CPU-only build, a driver too old): training on the CPU instead would hold the GPU idle and
    run many times slower without a word."""
    if gpu is None:
        gpu = torch.cuda.is_available()
    if not gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise GpuUnavailableError(
            f"node {socket.gethostname()}: rank {os.environ.get('RANK', '?')} was given a GPU "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}) but torch {torch.__version__} "
            f"cannot use it ({_why_no_cuda()}); install a CUDA build of torch that the node's driver supports, "
            f"or set cluster.use_gpu=false"
        )
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def _why_no_cuda() -> str:
    """Why torch cannot use CUDA here, for the error of a rank given a GPU."""
    if torch.version.cuda is None:
        return "a CPU-only build"
    try:
        torch.cuda.init()  # raises, giving torch's own reason: no driver, one too old for this build
    except Exception as e:
        return f"built for CUDA {torch.version.cuda}: {(str(e).strip().splitlines() or [type(e).__name__])[0]}"
    return f"built for CUDA {torch.version.cuda}, it finds no GPU"


def init_from_env(timeout_s: float = 600.0, gpu: bool | None = None) -> torch.device:
    """NCCL and the local GPU on a GPU rank (`gpu`; None: when CUDA is visible), gloo and the CPU otherwise.
    On GPUs gloo runs beside NCCL for tensors in CPU memory: CPU offload's gradient norm, and the trainer's
    per-step agreement on stopping, which must not wait on the GPU's queue. `timeout_s` bounds the
    rendezvous and is every collective's timeout until `set_timeout` says otherwise.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, exactly as torchrun sets them,
    so the same code runs under Ray workers and under plain torchrun. A group this function formed
    before (an earlier attempt in the same worker, which did not end it) is aborted, never reused: its
    peers are gone. A group someone else formed (Ray Train) is used if it is this rank's.
    """
    global _formed
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    loopback = ipaddress.ip_address(socket.gethostbyname(os.environ["MASTER_ADDR"])).is_loopback
    if loopback:
        # gloo binds to the address the hostname resolves to, which may be an external interface.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    device = device_for(gpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with _lock:
        if _formed:
            _abort()
        if dist.is_initialized():
            if (dist.get_rank(), dist.get_world_size()) != (rank, world):
                raise RuntimeError(
                    f"a process group of rank {dist.get_rank()} in {dist.get_world_size()} exists, but the "
                    f"environment says rank {rank} in {world}"
                )
            return device
        forget_meshes()
        if rank > 0:
            wait_for_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout_s)
        store = _loopback_store(rank, world, timeout_s) if loopback else None
        dist.init_process_group(
            "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
            store=store,
            rank=rank if store is not None else -1,
            world_size=world if store is not None else -1,
        )
        _formed = True
    return device


def forget_meshes() -> None:
    """Empty DTensor's sharding caches (Python's and, where torch has it, the C++ fast path's) before new
    groups form. They keep the device meshes of the ops they saw, and torch counts two meshes equal by their
    ranks and dim names alone, not their groups: a worker's next attempt (or run) that builds a mesh of the
    same shape would be handed the old one, whose group names no longer resolve or name other groups now
    ("Could not resolve the process group registered under the name 7", seen in the suite)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def _loopback_store(rank: int, world: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT, rank 0's server listening on that loopback
    address only: left to itself, torch's store server listens on every interface ("::")."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    listen_fd = None
    if rank == 0:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
        listen_fd = sock.detach()
    return dist.TCPStore(
        host, port, world, rank == 0, timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=listen_fd
    )


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


def set_timeout(timeout_s: float) -> None:
    """The timeout of every collective started from now on, in every group of this process: the mesh's
    groups too, which would otherwise keep torch's defaults (10 minutes on NCCL, 30 on gloo)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    for group in list(distributed_c10d._world.pg_map):
        distributed_c10d._set_pg_timeout(timeout, group)


def abort() -> bool:
    """End every group of this process at once, without waiting for collectives in flight: for a rank
    whose peer died, which a graceful destroy would leave waiting on it. Safe from another thread while
    the rank's own waits in a collective. Whether that collective now returns: on NCCL it does (its
    communicators are aborted); on gloo it still waits for its peer's connection to close or its timeout."""
    with _lock:
        return _abort()


def _abort() -> bool:
    global _formed
    if not dist.is_initialized():
        return False
    frees = "nccl" in str(dist.get_backend())
    _ended.extend(distributed_c10d._world.pg_map)
    distributed_c10d._abort_process_group()
    _formed = False
    return frees


def destroy() -> None:
    """End the groups gracefully: after a rank's work is done (a failed rank aborts them instead)."""
    global _formed
    with _lock:
        if dist.is_initialized():
            _ended.extend(distributed_c10d._world.pg_map)
            dist.destroy_process_group()
        _formed = False


def release() -> None:
    """Let go of the groups `abort` and `destroy` ended: once what used them (the model) is gone."""
    with _lock:
        _ended.clear()


def check_device() -> bool:
    """Whether this process can still run work on its device: a sticky CUDA error (an illegal address,
    an uncorrectable ECC error) leaves a process that answers pings but fails everything it runs later.
    On CUDA a tiny kernel and a synchronize of the whole device, which raise (or never return) if it is
    unusable; on the CPU there is nothing to check."""
    if not torch.cuda.is_available():
        return True
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.ones(1, device=device).add_(1)
    torch.cuda.synchronize(device)
    return True
