"""The parameter servers of one attempt, as a group: started, called together, drained without
ever blocking on a silent one, and saved into a staging directory a checkpoint is committed from. A
server that dies or stops answering loses the attempt (AttemptLost): only a restore from the last
checkpoint helps then."""

from __future__ import annotations

import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from distrain.cluster import kill, warm
from distrain.cluster.attempt import first_line
from distrain.cluster.placement import PlacementError, WorkerFailure
from distrain.cluster.states import AttemptLost
from distrain.ps.job import ServerJob

SERVER_CALLS = 4  # a server's threads beyond one per worker: the driver's drains, saves, stops


class ServerGroup:
    def __init__(
        self, job: ServerJob, num_servers: int, num_workers: int, cpus: float, timeout_s: float, env: dict[str, str]
    ):
        """Servers spread over the nodes; timeout_s bounds their start and how long one may stay silent; `env`: the
        driver's variables every worker gets (GroupSpec.env). The servers an earlier run of this driver kept
        (cluster.reuse_workers) start over with `job`."""
        self.timeout_s, self.cpus = timeout_s, cpus
        self.job = ray.get_runtime_context().get_job_id()
        concurrency = num_workers + SERVER_CALLS
        self.key = ("parameter servers", num_servers, cpus, concurrency)
        self.drains: dict[int, tuple] = {}  # server → (its unanswered drain, when asked)
        kept = warm.reuse(self.key)
        if kept is not None:
            self.actors = kept.actors
            self.starting = [srv.reset.remote(job, k, env) for k, srv in enumerate(self.actors)]
            return
        from distrain.ps.server import ParameterServer  # torch: in the driver only when a parameter server runs

        warm.make_room({"CPU": cpus * num_servers})
        self.actors = [
            ray.remote(ParameterServer)
            .options(num_cpus=cpus, max_concurrency=concurrency, scheduling_strategy="SPREAD")
            .remote(job, k, env)
            for k in range(num_servers)
        ]
        self.starting = [srv.node_info.remote() for srv in self.actors]

    def start(self) -> list[dict]:
        """Where each server runs, once all have started."""
        try:
            return ray.get(self.starting, timeout=self.timeout_s)
        except (RayActorError, RayTaskError) as e:  # it raised starting: a checkpoint it cannot load, a bad config
            raise WorkerFailure(f"a parameter server could not start: {first_line(e, limit=1000)}") from e
        except GetTimeoutError as e:
            raise PlacementError(
                f"{len(self.actors)} parameter servers did not start within cluster.setup_timeout_s="
                f"{self.timeout_s:g}; free: {ray.available_resources()}"
            ) from e

    def call(self, method: str, *args: object, timeout_s: float | None = None) -> list:
        """Call every server and wait; a dead one loses the attempt, an error it raised (a full disk) ends the run."""
        try:
            return ray.get([getattr(srv, method).remote(*args) for srv in self.actors], timeout=timeout_s)
        except RayActorError as e:
            raise AttemptLost(f"a parameter server failed: {first_line(e)}") from e
        except RayTaskError as e:
            raise WorkerFailure(f"a parameter server's {method} failed: {first_line(e)}") from e

    def check(self, timeout_s: float) -> None:
        """AttemptLost if a server is dead; busy is not dead (the drains judge silence)."""
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
                    raise AttemptLost(f"parameter server {k} has not answered for {self.timeout_s:g} s")
                continue
            del self.drains[k]
            try:
                answer = ray.get(ref)
            except RayError as e:
                raise AttemptLost(f"parameter server {k} failed: {first_line(e)}") from e
            first = answer if k == 0 else first
        return first

    def save(self, staging: str) -> tuple[dict[int, int], dict[str, dict[str, int]], dict[str, int]]:
        """Every shard writes its state into the staging directory `staging` of the run's checkpoints. Returns, per
        worker, the last step of it every shard's saved weights hold (async workers are at different steps), and
        for the commit each shard's file with its size, and each file's checksum."""
        saved = self.call("save", staging)
        applied = {w: min(s["applied"][w] for s in saved) for w in saved[0]["applied"]}
        files = {f"parameter server {k}": {s["file"]: s["size"]} for k, s in enumerate(saved)}
        return applied, files, {s["file"]: s["crc32"] for s in saved}

    # -- as a warm.Kept group -------------------------------------------------------------------

    def resources(self) -> dict[str, float]:
        return {"CPU": self.cpus * len(self.actors)}

    def release(self) -> None:
        """Keep the servers for the next run of this driver with as many servers, workers and CPUs."""
        self.drains = {}
        warm.keep(self)

    def shutdown(self) -> None:
        kill.end(self.actors)
        self.actors, self.drains = [], {}
