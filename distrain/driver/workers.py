"""What a run asks of the Ray cluster: the worker group's spec from the config (its devices, the environment
the workers get), and the cluster attached to or started, once it could hold the group and a rank's memory fits."""

from __future__ import annotations

import os
from collections.abc import Callable

from distrain.cluster.placement import GroupSpec
from distrain.cluster.resources import embedded_resources
from distrain.cluster.runtime import check_capacity, connect, gpu_count, wait_for_gpus
from distrain.config import ClusterConfig, TrainConfig, attach_address
from distrain.driver.console import once
from distrain.driver.fits import check_fits
from distrain.strategy.layout import Layout


def print_event(text: str) -> None:
    """A driver's event line, where there is no progress line to print it (a plan)."""
    print(f"distrain: {text}", flush=True)


def group_spec(
    cfg: TrainConfig,
    layout: Layout,
    say: Callable[[str], None] = print_event,
    gpus_now: Callable[[], float] = gpu_count,
) -> GroupSpec:
    """The worker group the config asks for. With cluster.use_gpu=null, a GPU per worker if the cluster
    has GPUs now (`gpus_now`: Ray's count, or an embedded cluster's before it starts): which one was chosen,
    and why, is said (an autoscaling cluster may have none up yet)."""
    c = cfg.cluster
    use_gpu = c.use_gpu
    if use_gpu is None:
        gpus = gpus_now()
        use_gpu = gpus > 0
        say(
            f"cluster.use_gpu=null: the cluster has {gpus:g} GPUs, so each worker gets one"
            if use_gpu
            else "cluster.use_gpu=null: the cluster has no GPU now, so the workers train on CPUs; set "
            "cluster.use_gpu=true to wait for GPU nodes (an autoscaler starts them for work that asks)"
        )
    return GroupSpec(
        num_workers=c.num_workers,
        cpus_per_worker=c.cpus_per_worker,
        gpus_per_worker=1 if use_gpu else 0,
        threads_per_worker=c.threads_per_worker,
        placement_strategy=c.placement_strategy,
        placement_timeout_s=c.placement_timeout_s,
        start_timeout_s=c.setup_timeout_s,
        node_group=layout.tp,  # a tensor-parallel group never spans two nodes
        spares=c.spares,
        env=worker_env(c),
    )


# W&B's settings and key, the collectives', torch's, and the object stores' (credentials, endpoint: never in the
# config; gcsfs's settings and an emulator's endpoint): passed with each call to the workers, never recorded.
FORWARDED = (
    *("WANDB_", "NCCL_", "GLOO_", "TORCH_", "CUDA_"),
    *("AWS_", "GOOGLE_", "AZURE_", "GCSFS_", "STORAGE_EMULATOR_HOST"),
)


def worker_env(c: ClusterConfig) -> tuple[tuple[str, str], ...]:
    """What every worker gets of the user's environment, which workers on other hosts do not share: the
    driver's variables of the FORWARDED families (not CUDA_VISIBLE_DEVICES: each node has its own GPUs),
    then cluster.env_vars. Either may name gloo's and NCCL's interface, which then overrides the one each
    worker finds for its node address."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED) and k != "CUDA_VISIBLE_DEVICES"}
    return tuple(sorted({**env, **c.env_vars}.items()))


def placeable_spec(cfg: TrainConfig, layout: Layout, say: Callable[[str], None] = print_event) -> GroupSpec:
    """The worker group, once the cluster could hold its workers, spares and servers and (a run, not a plan)
    a rank's estimated memory fits; with cluster.use_gpu=true on a cluster attached to, first wait
    (placement_timeout_s) for GPUs it lacks. An embedded cluster is checked against what it will have and then
    started (a plan starts none); one attached to, or up in this process already, is asked. `say` prints events."""
    c, address = cfg.cluster, attach_address(cfg.cluster.address)
    here = embedded_resources(c.address, c.local_cpus, c.local_gpus)
    if address:
        wait = f"giving up after cluster.connect_timeout_s={c.connect_timeout_s:g} s"
        say(f"attaching to the Ray cluster at {address} ({wait})")
    if here is None:
        connect(c.address, timeout_s=c.connect_timeout_s, say=say)
    choice: list[str] = []  # which devices cluster.use_gpu=null chose: said once the run is not refused
    spec = group_spec(cfg, layout, choice.append, gpu_count if here is None else lambda: here["GPU"])
    if c.use_gpu and address:  # an embedded cluster has no autoscaler: the GPUs it lacks now never come
        wait_for_gpus(spec, say)
    servers = cfg.ps.num_servers if cfg.ps.mode is not None else 0
    check_capacity(spec.num_workers, spec.cpus_per_worker, spec.gpus_per_worker, spec.spares, servers, here)
    if not cfg.plan:  # a plan says the check's verdict instead
        check_fits(cfg, layout, spec.gpus_per_worker > 0, say, here)
    for line in choice:
        once(say, line)
    if here is not None and not cfg.plan:  # "local": the embedded cluster checked, whatever RAY_ADDRESS says
        connect("local", c.local_cpus, c.local_gpus, say=say)
    return spec
