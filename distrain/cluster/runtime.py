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


def check_capacity(num_workers: int, cpus_per_worker: float, gpus_per_worker: int) -> None:
    """Fail before any actor starts when the whole cluster could never place the group."""
    total = ray.cluster_resources()
    for resource, each in (("CPU", cpus_per_worker), ("GPU", gpus_per_worker)):
        need, have = num_workers * each, total.get(resource, 0)
        if each and need > have:
            key = "cluster.cpus_per_worker" if resource == "CPU" else "GPUs per worker"
            raise CapacityError(
                f"cluster.num_workers={num_workers} needs {need:g} {resource} ({key}={each:g} each) but the "
                f"cluster has {have:g}; lower cluster.num_workers"
                + (" or cluster.cpus_per_worker" if resource == "CPU" else " or add GPU nodes")
            )
