"""Attach to a Ray cluster, or start an embedded one on this machine."""

from __future__ import annotations

import os

import ray


class CapacityError(RuntimeError):
    """The cluster can never hold the workers asked for."""


def attach_address(address: str | None) -> str | None:
    """The existing cluster to attach to: `address`, else RAY_ADDRESS (how `ray job submit` runs
    us); None (or "local") means an embedded cluster on this machine."""
    address = address or os.environ.get("RAY_ADDRESS")
    return None if address in (None, "", "local") else address


def connect(address: str | None) -> None:
    """Attach to the cluster `attach_address` names, or start a local one on loopback only (see the
    package's __init__); `address="local"` keeps Ray from joining a stale `ray start` cluster."""
    if ray.is_initialized():
        return
    address = attach_address(address)
    if address:
        ray.init(address=address, logging_level="WARNING")
        return
    ray.init(address="local", include_dashboard=False, logging_level="WARNING")


def has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def check_capacity(num_workers: int, cpus_per_worker: float, gpus_per_worker: int, num_servers: int = 0) -> None:
    """Fail before any actor starts when the whole cluster could never place the group (and its
    parameter servers, which take a worker's CPUs each and no GPU)."""
    total = ray.cluster_resources()
    who = f"cluster.num_workers={num_workers}" + (f" with strategy.num_servers={num_servers}" if num_servers else "")
    for resource, each, actors in (
        ("CPU", cpus_per_worker, num_workers + num_servers),
        ("GPU", gpus_per_worker, num_workers),
    ):
        need, have = actors * each, total.get(resource, 0)
        if each and need > have:
            key = "cluster.cpus_per_worker" if resource == "CPU" else "GPUs per worker"
            raise CapacityError(
                f"{who} needs {need:g} {resource} ({key}={each:g} each) but the cluster has {have:g}; "
                f"lower cluster.num_workers or {'cluster.cpus_per_worker' if resource == 'CPU' else 'add GPU nodes'}"
            )
