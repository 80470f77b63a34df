"""Attach to a Ray cluster, or start an embedded one on this machine."""

from __future__ import annotations

import logging
from collections.abc import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from distrain.cluster.placement import GroupSpec
from distrain.config import attach_address


class CapacityError(RuntimeError):
    """The cluster can never hold the workers asked for."""


def connect(address: str | None, num_cpus: int | None = None, num_gpus: int | None = None) -> None:
    """Attach to the cluster `attach_address` names, or start a local one on loopback only (see the
    package's __init__) with `num_cpus` and `num_gpus` (None: the machine's); `address="local"`
    keeps Ray from joining a stale `ray start` cluster."""
    if ray.is_initialized():
        return
    address = attach_address(address)
    if address:
        ray.init(address=address, logging_level="WARNING")
        return
    # Ray enables token authentication on a new local cluster unless RAY_AUTH_MODE says otherwise, and warns
    # on every start that it did. Setting the variable ourselves is no cure: Ray caches its config when first
    # imported, so a process that imported Ray before distrain would start its cluster with one mode and
    # connect with the other. Ray's choice is kept; its warning is not printed.
    announcer = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = announcer.level
    announcer.setLevel(logging.ERROR)
    try:
        ray.init(
            address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, logging_level="WARNING"
        )
    finally:
        announcer.setLevel(level)


def gpu_count() -> float:
    """The GPUs of the cluster's alive nodes, taken or free."""
    return ray.cluster_resources().get("GPU", 0)


def wait_for_gpus(spec: GroupSpec, say: Callable[[str], None]) -> None:
    """For cluster.use_gpu=true on a cluster with fewer GPUs than the group's bundles hold (an autoscaling
    one may have no GPU node up yet): say so, and wait up to spec.placement_timeout_s with a trial
    placement group of those bundles pending, which is the demand Ray's autoscaler starts nodes for.
    CapacityError if the GPUs are still missing then; once they are there, placing the group is the
    group's own wait."""
    need, have = sum(b.get("GPU", 0) for b in spec.bundles()), gpu_count()
    if have >= need:
        return
    timeout_s = spec.placement_timeout_s
    say(
        f"cluster.use_gpu=true: waiting up to {timeout_s:g} s (cluster.placement_timeout_s) for the {need:g} GPUs "
        f"the workers need; the cluster has {have:g}"
    )
    trial = placement_group(spec.bundles(), strategy=spec.placement_strategy)
    try:
        ray.wait([trial.ready()], timeout=timeout_s)
    finally:
        remove_placement_group(trial)
    have = gpu_count()
    if have < need:
        raise CapacityError(
            f"cluster.use_gpu=true: the workers need {need:g} GPUs and the cluster had {have:g} after waiting "
            f"cluster.placement_timeout_s={timeout_s:g}; add GPU nodes (or give an autoscaler longer), or set "
            f"cluster.use_gpu=false"
        )


def check_capacity(
    num_workers: int, cpus_per_worker: float, gpus_per_worker: int, spares: int = 0, num_servers: int = 0
) -> None:
    """Fail before any actor starts when the whole cluster could never place the group, its hot
    spares (a worker's resources each) and its parameter servers (a worker's CPUs each, no GPU)."""
    total = ray.cluster_resources()
    extra = [f"cluster.spares={spares}"] * bool(spares) + [f"ps.num_servers={num_servers}"] * bool(num_servers)
    who = f"cluster.num_workers={num_workers}" + (f" with {' and '.join(extra)}" if extra else "")
    for resource, each, actors in (
        ("CPU", cpus_per_worker, num_workers + spares + num_servers),
        ("GPU", gpus_per_worker, num_workers + spares),
    ):
        need, have = actors * each, total.get(resource, 0)
        if each and need > have:
            key = "cluster.cpus_per_worker" if resource == "CPU" else "GPUs per worker"
            raise CapacityError(
                f"{who} needs {need:g} {resource} ({key}={each:g} each) but the cluster has {have:g}; "
                f"lower cluster.num_workers or {'cluster.cpus_per_worker' if resource == 'CPU' else 'add GPU nodes'}"
            )
