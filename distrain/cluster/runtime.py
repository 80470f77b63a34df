"""Attach to a Ray cluster, or start an embedded one on this machine."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import ray
from ray._private import worker as ray_worker
from ray.util.placement_group import placement_group, remove_placement_group

from distrain.cluster.notices import hide_worker_deaths
from distrain.cluster.placement import GroupSpec
from distrain.config import attach_address


class CapacityError(RuntimeError):
    """The cluster can never hold the workers asked for."""


class AttachError(CapacityError):
    """No Ray cluster answers at the address the run attaches to."""


class StartError(RuntimeError):
    """The embedded cluster did not start, tried twice."""


RAY_CLIENT_PORT = 10001  # a `ray://host` address without a port
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # a gRPC server (Ray's GCS) answers it with SETTINGS
SETTINGS_FRAME = 0x04


def connect(
    address: str | None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    timeout_s: float = 10.0,
    say: Callable[[str], None] = print,
) -> None:
    """Attach to the cluster `attach_address` names, or start a local one on loopback only (see the
    package's __init__) with `num_cpus` and `num_gpus` (None: the machine's); `address="local"`
    keeps Ray from joining a stale `ray start` cluster. Attaching gives up with AttachError when no
    gRPC server answers at the address within `timeout_s` (Ray itself retries for about 12 minutes
    with nothing but warnings, and a Ctrl-C cannot reach the driver while it does). A local cluster that
    fails to start is started once more, as a user would (`say` tells them), then StartError in one line.
    Ray's notices of worker deaths are kept off the console (`notices`)."""
    hide_worker_deaths()
    if ray.is_initialized():
        return
    address = attach_address(address)
    if address:
        probe(address, timeout_s)
        with one_gcs_attempt():
            try:
                ray.init(address=address, logging_level="WARNING")
            except ConnectionError as e:
                raise AttachError(unreachable(address, f"Ray could not attach: {e}")) from None
        return
    # Ray enables token authentication on a new local cluster unless RAY_AUTH_MODE says otherwise, and warns
    # on every start that it did. Setting the variable ourselves is no cure: Ray caches its config when first
    # imported, so a process that imported Ray before distrain would start its cluster with one mode and
    # connect with the other. Ray's choice is kept; its warning is not printed.
    announcer = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = announcer.level
    announcer.setLevel(logging.ERROR)
    try:
        for attempt in (1, 2):
            try:
                with sigterm_held():
                    ray.init(
                        address="local",
                        num_cpus=num_cpus,
                        num_gpus=num_gpus,
                        include_dashboard=False,
                        logging_level="WARNING",
                    )
                break
            except Exception as e:  # Ray raises bare Exceptions ("The current node timed out during startup")
                ray.shutdown()  # what it did start ends
                why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
                if attempt == 2:
                    raise StartError(not_started(why)) from None
                say(f"the embedded Ray cluster did not start ({why}); starting it once more")
    finally:
        announcer.setLevel(level)
    kill_at_shutdown()


def kill_at_shutdown() -> None:
    """Ray's shutdown sends each process of the cluster it started SIGTERM and gives it a second to end before
    its SIGKILL. The embedded cluster's block SIGTERM (`sigterm_held`): that was a second each, five at every
    end of the driver (a Ctrl-C's too), for nothing. They get the SIGKILL at once, and so do the processes they
    started: the raylet's agents, which a raylet ended gracefully ends itself, outlive one that is killed."""
    node = ray_worker._global_node  # this driver's node: the processes ray.init started (none when attached)
    kill_all = node.kill_all_processes

    def kill_all_at_once(*args, **kwargs):
        started = {info.process.pid for infos in node.all_processes.values() for info in infos}
        below = descendants(started)
        kill_all(*args, **{**kwargs, "allow_graceful": False})
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    node.kill_all_processes = kill_all_at_once


def descendants(pids: set[int]) -> list[int]:
    """The processes below `pids` (their children, theirs, ...), as /proc shows them now; none where it does not."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):  # a process that ended meanwhile
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, level = [], set(pids)
    while level:
        level = {pid for pid, parent in parents.items() if parent in level}
        found += sorted(level)
    return found


def not_started(why: str) -> str:
    """The one line an embedded cluster that failed twice to start prints: why, what to look at (Ray's logs are
    under RAY_TMPDIR, else TMPDIR, else /tmp, as Ray picks its temp dir), and for a start that timed out (Ray's
    processes too slow on a loaded machine) what to do instead."""
    logs = os.path.join(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp", "ray", "session_latest")
    slow = "timed out" in why.lower()
    advice = (
        "on a loaded machine Ray's processes may need longer than its 30 s (try again when it is quieter, or start "
        "one with `distrain cluster start` and attach with cluster.address); "
        if slow
        else ""
    )
    return f"the embedded Ray cluster did not start, twice: {why}; {advice}Ray's own logs are in {logs}/logs"


@contextlib.contextmanager
def sigterm_held() -> Iterator[None]:
    """SIGTERM blocked in this thread while an embedded cluster starts: its processes (GCS, raylet and what
    they start) inherit the mask, as Ray has them inherit a blocked SIGINT. They share the driver's process
    group, so a SIGTERM to the group (`timeout`, systemd, a scheduler) would otherwise end the cluster under
    the driver, which then waits a minute on the dead GCS instead of stopping cleanly. Ray's shutdown ends
    them with SIGKILL (`kill_at_shutdown`). A Python handler the caller had (the driver's stop) is put back
    before the mask is lifted, which delivers a SIGTERM that came meanwhile: ray.init replaced it with one
    that aborts."""
    before = signal.getsignal(signal.SIGTERM)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        if callable(before):
            signal.signal(signal.SIGTERM, before)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def probe(address: str, timeout_s: float) -> None:
    """AttachError unless a gRPC server (a GCS, or a Ray Client server for `ray://`) answers at `address`
    within timeout_s: refused, unreachable, silent, or something else there (the dashboard's HTTP port).
    `auto` is left to Ray, which looks for a cluster on this machine and says at once if it finds none."""
    if address == "auto":
        return
    client = address.startswith("ray://")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        host, port = address.removeprefix("ray://"), str(RAY_CLIENT_PORT) if client else ""
    if not port.isdigit():
        raise AttachError(
            f"cluster.address / RAY_ADDRESS {address!r} is not host:port (the head's GCS port, 6379 unless "
            f"`ray start --port` said otherwise) or ray://host:port"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.sendall(HTTP2_PREFACE)
            answer = sock.recv(9)
    except TimeoutError:
        raise AttachError(unreachable(address, f"no answer within {timeout_s:g} s")) from None
    except OSError as e:
        raise AttachError(unreachable(address, (e.strerror or str(e)).lower())) from None
    tls = os.environ.get("RAY_USE_TLS", "0") not in ("0", "")  # its handshake is not plain HTTP/2
    if not tls and (len(answer) < 4 or answer[3] != SETTINGS_FRAME):
        raise AttachError(unreachable(address, "something answers there, but not a Ray cluster's GCS"))


def unreachable(address: str, why: str) -> str:
    """The one line a failed attach prints: the address, why, and what to check."""
    source = "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") == address else "cluster.address"
    return (
        f"cannot attach to the Ray cluster at {address} ({source}): {why}; check that `ray start --head` runs there "
        f"and `ray status --address {address.removeprefix('ray://')}` answers, or unset RAY_ADDRESS (and "
        f"cluster.address) to train on an embedded cluster on this machine (cluster.connect_timeout_s sets the wait)"
    )


@contextlib.contextmanager
def one_gcs_attempt() -> Iterator[None]:
    """Ray tries its GCS 20 times, about 35 s each, before giving up: once is enough once the probe has
    seen a gRPC server there (RAY_gcs_server_port_wait_time_s counts the tries, read when ray.init runs;
    a value the user set is kept). Only while attaching: an embedded cluster's start reads it too."""
    key = "RAY_gcs_server_port_wait_time_s"
    given = os.environ.get(key)
    os.environ.setdefault(key, "1")
    try:
        yield
    finally:
        if given is None:
            os.environ.pop(key, None)


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
    num_workers: int,
    cpus_per_worker: float,
    gpus_per_worker: int,
    spares: int = 0,
    num_servers: int = 0,
    total: dict[str, float] | None = None,
) -> None:
    """Fail before any actor starts when the whole cluster could never place the group, its hot
    spares (a worker's resources each) and its parameter servers (a worker's CPUs each, no GPU).
    `total`: the cluster's resources (an embedded one's before it starts); None: Ray's now."""
    total = ray.cluster_resources() if total is None else total
    extra = [f"cluster.spares={spares}"] * bool(spares) + [f"ps.num_servers={num_servers}"] * bool(num_servers)
    who = f"cluster.num_workers={num_workers}" + (f" with {' and '.join(extra)}" if extra else "")
    for resource, each, actors in (
        ("CPU", cpus_per_worker, num_workers + spares + num_servers),
        ("GPU", gpus_per_worker, num_workers + spares),
    ):
        need, have = actors * each, total.get(resource, 0)
        if each and need > have:
            key = "cluster.cpus_per_worker" if resource == "CPU" else "GPUs per worker"
            fix = "cluster.cpus_per_worker" if resource == "CPU" else "add GPU nodes (or set cluster.use_gpu=false)"
            raise CapacityError(
                f"{who} needs {need:g} {resource} ({key}={each:g} each) but the cluster has {have:g}; "
                f"lower cluster.num_workers or {fix}"
            )
