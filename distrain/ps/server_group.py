"""The parameter servers of one attempt, as a group: started, called together, drained without
ever blocking on a silent one, and checkpointed into one committed directory. A server that dies
or stops answering is ServerLost: only a restore from the last checkpoint helps then."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from distrain import checkpoint
from distrain.cluster.placement import PlacementError, WorkerFailure
from distrain.cluster.worker_group import first_line
from distrain.fsutil import write_json
from distrain.ps.server import ParameterServer

RemoteServer = ray.remote(ParameterServer)
SERVER_CALLS = 4  # a server's threads beyond one per worker: the driver's drains, saves, stops


class ServerLost(RuntimeError):
    """A server died or stopped answering."""


class ServerGroup:
    def __init__(self, job: dict, num_servers: int, num_workers: int, cpus: float, timeout_s: float):
        """Servers spread over the nodes; timeout_s bounds their start and how long one may stay silent."""
        self.timeout_s = timeout_s
        self.actors = [
            RemoteServer.options(
                num_cpus=cpus, max_concurrency=num_workers + SERVER_CALLS, scheduling_strategy="SPREAD"
            ).remote(job, k)
            for k in range(num_servers)
        ]
        self.drains: dict[int, tuple] = {}  # server → (its unanswered drain, when asked)

    def start(self) -> list[dict]:
        """Where each server runs, once all have started."""
        try:
            return ray.get([srv.node_info.remote() for srv in self.actors], timeout=self.timeout_s)
        except RayActorError as e:  # its constructor raised: a checkpoint it cannot load, a bad config
            raise WorkerFailure(f"a parameter server could not start: {first_line(e)}") from e
        except GetTimeoutError as e:
            raise PlacementError(
                f"{len(self.actors)} parameter servers did not start within cluster.setup_timeout_s="
                f"{self.timeout_s:g}; free: {ray.available_resources()}"
            ) from e

    def call(self, method: str, *args: object, timeout_s: float | None = None) -> list:
        """Call every server and wait; a dead one is ServerLost, an error it raised (a full disk) ends the run."""
        try:
            return ray.get([getattr(srv, method).remote(*args) for srv in self.actors], timeout=timeout_s)
        except RayActorError as e:
            raise ServerLost(f"a parameter server failed: {first_line(e)}") from e
        except RayTaskError as e:
            raise WorkerFailure(f"a parameter server's {method} failed: {first_line(e)}") from e

    def check(self, timeout_s: float) -> None:
        """ServerLost if a server is dead; busy is not dead (the drains judge silence)."""
        try:
            self.call("node_info", timeout_s=timeout_s)
        except GetTimeoutError:
            pass

    def forget(self, rank: int) -> None:
        """A worker is being replaced: release what it held (its staleness turn)."""
        for srv in self.actors:
            srv.forget.remote(rank)

    def drain(self, wait_s: float = 0.0) -> dict | None:
        """Shard 0's answer (the workers' records and its version) if it came within wait_s. Every
        server is asked, so that one silent for timeout_s, or dead, is found."""
        for k, srv in enumerate(self.actors):
            if k not in self.drains:
                self.drains[k] = (srv.drain.remote(), time.monotonic())
        refs = [ref for ref, _ in self.drains.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        first = None
        for k, (ref, asked) in list(self.drains.items()):
            if ref not in ready:
                if time.monotonic() - asked > self.timeout_s:
                    raise ServerLost(f"parameter server {k} has not answered for {self.timeout_s:g} s")
                continue
            del self.drains[k]
            try:
                answer = ray.get(ref)
            except RayError as e:
                raise ServerLost(f"parameter server {k} failed: {first_line(e)}") from e
            first = answer if k == 0 else first
        return first

    def save(self, root: Path, after: int, meta: dict, keep: int) -> int:
        """Every shard saves; the checkpoint's step is the last step every worker has in the weights
        (async workers are at different steps), known only once the shards have saved. It is
        committed if newer than `after`; returns the newest committed step."""
        staging = root / f".saving-{uuid.uuid4().hex[:8]}"  # not a step directory: never loaded
        staging.mkdir(parents=True)
        try:
            written = self.call("save", str(staging))
            step = min(held for _, _, held in written)
            if step <= after:  # nothing new since the last one (the end after a final interval)
                return after
            write_json(staging / checkpoint.META_FILE, {"step": step, **meta})
            staging.rename(checkpoint.prepare(root, step))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        views = {f"parameter server {k}": {name: size} for k, (name, size, _) in enumerate(written)}
        checkpoint.commit(root, step, views, keep, reader="the driver")
        return step

    def shutdown(self) -> None:
        for srv in self.actors:
            ray.kill(srv, no_restart=True)
        self.actors, self.drains = [], {}
