"""Workers kept warm, so that a rank costs no process start (a Python process, then torch's import:
seconds on a small machine): hot spares beside a running group, and whole groups (workers, or a run's
parameter servers) kept between the runs of one driver."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import ray
from ray.exceptions import RayError

from distrain.cluster.worker import Fn

WarmUp = tuple[Fn, tuple]  # what a spare runs while it waits: fn(*args)


@dataclass
class Spare:
    """A started worker holding no rank: its actor, its bundle, and its warm-up call (→ node info)."""

    actor: Any
    bundle: int
    ready: ray.ObjectRef

    def info(self) -> dict | None:
        """Where it runs, once warm; None while it is still warming up or if it died."""
        done, _ = ray.wait([self.ready], timeout=0)
        if not done:
            return None
        try:
            return {**ray.get(self.ready), "bundle": self.bundle}
        except RayError:
            return None


def start_spare(make_actor: Callable[[int], Any], bundle: int, warm_up: WarmUp | None) -> Spare:
    actor = make_actor(bundle)
    fn, args = warm_up or (_nothing, ())
    return Spare(actor, bundle, actor.warm.remote(fn, *args))


def _nothing() -> None:
    pass


def take_spare(spares: list[Spare], node_id: str | None) -> tuple[Spare, dict] | None:
    """A warm spare (on `node_id` if given: a rank whose block must stay on one node), removed
    from `spares`; None if there is none. Dead spares are dropped."""
    for spare in list(spares):
        info = spare.info()
        if info is None and ray.wait([spare.ready], timeout=0)[0]:  # it finished warming, then failed
            spares.remove(spare)
            ray.kill(spare.actor, no_restart=True)
            continue
        if info is not None and (node_id is None or info["node_id"] == node_id):
            spares.remove(spare)
            return spare, info
    return None


# -- groups kept between runs ---------------------------------------------------------------------


class Kept(Protocol):
    """What an ended run leaves for the next run of its driver (cluster.reuse_workers): a worker group's roster,
    a parameter-server group."""

    key: Any  # what the next run's group must be to take it: its spec
    job: str  # the Ray job (the cluster connection) its actors belong to
    actors: list  # every one answers node_info

    def resources(self) -> dict[str, float]:
        """The resources it holds on the cluster while kept."""

    def shutdown(self) -> None: ...


_KEPT: list[Kept] = []  # oldest first


def keep(group: Kept) -> None:
    _KEPT.append(group)


def reuse(key: Any) -> Kept | None:
    """A kept group of this key on the same cluster whose every actor still answers, removed from
    the kept ones; None if there is none."""
    job = ray.get_runtime_context().get_job_id()
    for group in list(_KEPT):
        if group.key != key or group.job != job:
            continue
        _KEPT.remove(group)
        try:
            ray.get([actor.node_info.remote() for actor in group.actors], timeout=5.0)
            return group
        except (RayError, ray.exceptions.GetTimeoutError):
            group.shutdown()
    return None


def make_room(need: dict[str, float], timeout_s: float = 5.0) -> None:
    """Let kept groups go, oldest first, until the cluster will have `need` free (or none is left),
    and wait for their resources to come back: Ray returns them a moment after the kill."""
    job = ray.get_runtime_context().get_job_id()
    _KEPT[:] = [g for g in _KEPT if g.job == job]  # a cluster that has gone took its groups with it

    def short(free: dict[str, float]) -> bool:
        return any(free.get(k, 0) + 1e-9 < v for k, v in need.items())

    expected = dict(ray.available_resources())
    if not _KEPT or not short(expected):
        return
    while _KEPT and short(expected):
        group = _KEPT.pop(0)
        for k, v in group.resources().items():
            expected[k] = expected.get(k, 0) + v
        group.shutdown()
    deadline = time.monotonic() + timeout_s
    while short(ray.available_resources()) and time.monotonic() < deadline:
        time.sleep(0.05)
