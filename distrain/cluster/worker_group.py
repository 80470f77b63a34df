"""A worker group's calls on an attempt: give each rank its torchrun-style environment, run a function on all
of them, watch the calls (poll, progress, stacks, questions beside them), and after a failure let go of the
workers that cannot go on. Which workers there are, and where, is its roster's (roster.py)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from distrain.cluster import kill, warm
from distrain.cluster.attempt import first_line
from distrain.cluster.placement import GroupSpec, WorkerFailure
from distrain.cluster.roster import Roster
from distrain.cluster.worker import Fn


class WorkerGroup:
    def __init__(self, spec: GroupSpec, warm_up: warm.WarmUp | None = None):
        """`warm_up`: what each hot spare runs while it waits for a rank (its imports, its data)."""
        self.spec, self.warm_up = spec, warm_up
        self.roster = Roster(spec)
        self.calls: dict = {}  # the running `run` call of each rank: ObjectRef → rank
        self.returned: set[int] = set()  # ranks whose call ended without their process dying
        self._asked: dict = {}  # rank → (its unanswered progress question, when asked)
        self._progress: dict[int, dict] = {}
        self.port = 0  # the rendezvous port of the last launch on every rank
        self.reserved_at: float | None = None  # when this group's own start found its placement group ready
        # What `release_unhealthy` runs in the ranks' processes, as the engine says (`recover_with`); None: a
        # ping that touches no device, and no abort.
        self.health_check: Fn | None = None
        self.abort_collectives: Fn | None = None

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self, patient: bool = False) -> list[dict]:
        """Start the roster (Roster.start), or take the roster of the same spec an earlier run of this driver
        kept (`release`). The rank table."""
        kept = warm.reuse(self.spec)
        if kept is not None:
            self.roster = kept
            return self.table
        table = self.roster.start(patient)
        self.reserved_at = self.roster.reserved_at
        return table

    @property
    def workers(self) -> list:
        """The worker actors, in rank order."""
        return self.roster.workers

    @property
    def table(self) -> list[dict]:
        """Where each rank runs (placement.rank_table), in rank order."""
        return self.roster.table

    def placement(self) -> list[dict]:
        return self.roster.placement()

    def restock(self) -> None:
        self.roster.restock(self.warm_up)

    # -- running --------------------------------------------------------------------------------

    def environments(self, port: int) -> list[dict[str, str]]:
        """What torchrun would set for each rank, plus threads, the node's visible GPUs, the network
        interface of the rank's node address for gloo and NCCL (unless the user named one), and the
        variables the spec forwards."""
        master = self.table[0]
        envs = []
        for entry in self.table:
            interface = {"GLOO_SOCKET_IFNAME": entry["interface"], "NCCL_SOCKET_IFNAME": entry["interface"]}
            env = {
                **(interface if entry.get("interface") else {}),
                "RANK": entry["rank"],
                "LOCAL_RANK": entry["local_rank"],
                "WORLD_SIZE": len(self.table),
                "LOCAL_WORLD_SIZE": entry["local_world_size"],
                "NODE_RANK": entry["node_rank"],
                "GROUP_RANK": entry["node_rank"],
                "MASTER_ADDR": master["node_ip"],
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": self.spec.threads_per_worker,
                # Every rank on a node sees all of the group's GPUs there (as under torchrun), so
                # NCCL can use peer-to-peer links; LOCAL_RANK indexes them, in GPU-id order. A CPU
                # worker sees none: Ray no longer hides a GPU machine's GPUs from num_gpus=0 actors.
                "CUDA_VISIBLE_DEVICES": ",".join(
                    map(str, sorted(g for e in self.table if e["node_id"] == entry["node_id"] for g in e["gpu_ids"]))
                ),
                **dict(self.spec.env),
            }
            envs.append({k: str(v) for k, v in env.items()})
        return envs

    def launch(self, fn: Fn, *args: Any, ranks: list[int] | None = None) -> None:
        """Start fn(*args, channel) on every rank (or on `ranks` only, beside calls still running),
        on a fresh rendezvous port; `poll` collects the results."""
        if ranks is None:  # a new rendezvous; ranks started beside running ones keep the last one's port
            ranks, self.calls = list(range(len(self.workers))), {}
            self.port = self._free_port()
        for ref in [self.workers[r].reset.remote() for r in ranks]:
            with contextlib.suppress(RayActorError):  # died since it was placed: its call below fails at once
                ray.get(ref)
        envs = self.environments(self.port)
        for r in ranks:
            self.calls[self.workers[r].run.remote(fn, envs[r], *args)] = r
            self.returned.discard(r)
            self._asked.pop(r, None)
            self._progress.pop(r, None)

    def _free_port(self) -> int:
        """A port free on rank 0's node, for the rendezvous; if rank 0 died since it was placed, any live worker's
        (the attempt fails with rank 0's call, seen as its death)."""
        for worker in self.workers:
            with contextlib.suppress(RayActorError):
                return ray.get(worker.free_port.remote())
        raise WorkerFailure("every worker of the group died before its attempt began")

    def run(self, fn: Fn, *args: Any, ranks: list[int] | None = None) -> list[Any]:
        """Run fn(*args, channel) on every rank (or on `ranks`) once, with no recovery (the
        supervisor's job): the first rank that raises or dies raises WorkerFailure. The results in
        rank order (None for ranks not run)."""
        self.launch(fn, *args, ranks=ranks)
        results: list[Any] = [None] * len(self.workers)
        while self.calls:
            for rank, value, error in self.poll(timeout_s=1.0):
                if error is not None:
                    raise WorkerFailure(f"{self.who(rank)} failed: {first_line(error)}") from error
                results[rank] = value
        return results

    def network(self) -> str:
        """Where the ranks met, and each host's address and the interface its ranks were given: what a
        process group that cannot form must tell the user."""
        named = dict(self.spec.env).get("GLOO_SOCKET_IFNAME")
        hosts = {e["node_ip"]: named or e.get("interface") or "no interface found" for e in self.table}
        return f"rendezvous {self.table[0]['node_ip']}:{self.port}, " + ", ".join(
            f"{ip} via {interface}" for ip, interface in hosts.items()
        )

    def who(self, rank: int) -> str:
        entry = self.table[rank]
        return f"rank {rank} (pid {entry['pid']} on {entry['node_ip']})"

    def poll(self, timeout_s: float) -> list[tuple[int, Any, RayError | None]]:
        """(rank, result, error) of every call that ended, waiting up to timeout_s for the first.
        Waiting on the calls themselves sees a rank that raises or whose process dies at once. A deadline
        already past (a negative timeout_s, computed as `deadline - now`) is a look without waiting."""
        if not self.calls:
            return []
        ready, _ = ray.wait(list(self.calls), num_returns=1, timeout=max(0.0, timeout_s))
        if ready:
            ready, _ = ray.wait(list(self.calls), num_returns=len(self.calls), timeout=0)
        ended = []
        for ref in ready:
            rank = self.calls.pop(ref)
            try:
                ended.append((rank, ray.get(ref), None))
                self.returned.add(rank)
            except RayError as e:
                ended.append((rank, None, e))
                if not isinstance(e, RayActorError):  # it raised: the process is alive and usable
                    self.returned.add(rank)
        return ended

    def progress(self) -> list[dict]:
        """The latest progress of each rank, never waiting on one that does not answer (a stopped
        or wedged process): its question stays open and its last answer stands."""
        for rank, w in enumerate(self.workers):
            if rank not in self._asked:
                self._asked[rank] = (w.progress.remote(), time.monotonic())
        refs = [ref for ref, _ in self._asked.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for rank, (ref, _) in list(self._asked.items()):
            if ref in ready:
                del self._asked[rank]
                try:
                    self._progress[rank] = ray.get(ref)
                except RayError:
                    pass
        return [self._progress.get(rank, {}) for rank in range(len(self.workers))]

    def last_progress(self, rank: int, timeout_s: float = 2.0) -> dict:
        """A rank's final report, asked again (for a rank whose call ended the polled one may be
        stale); the polled one if it cannot answer."""
        return self.final_progress([rank], timeout_s).get(rank) or self._progress.get(rank, {})

    def final_progress(self, ranks: list[int] | None = None, timeout_s: float = 2.0) -> dict[int, dict]:
        """The final reports of those of `ranks` (default all) that answer within timeout_s, asked at once."""
        ranks = list(range(len(self.workers))) if ranks is None else ranks
        return answers({rank: self.workers[rank].progress.remote() for rank in ranks}, timeout_s)

    def ask(self, fn: Fn, ranks: list[int] | None = None, timeout_s: float = 5.0) -> dict[int, Any]:
        """fn() in the processes of `ranks` (default all), beside their calls: the answers of those that give
        one within timeout_s (what a kept worker holds from the failed attempt, for recovery from replicas)."""
        ranks = list(range(len(self.workers))) if ranks is None else ranks
        return answers({rank: self.workers[rank].call.remote(fn) for rank in ranks}, timeout_s)

    def silent(self, longer_than_s: float) -> list[int]:
        """The ranks that have left a progress question unanswered for longer_than_s."""
        now = time.monotonic()
        return [rank for rank, (_, asked) in sorted(self._asked.items()) if now - asked > longer_than_s]

    def stacks(self, ranks: list[int] | None = None, timeout_s: float = 5.0) -> dict[int, str]:
        """The Python stacks of every rank (or of `ranks`); one that cannot answer in timeout_s says so instead."""
        ranks = list(range(len(self.workers))) if ranks is None else ranks
        refs = [self.workers[r].stacks.remote() for r in ranks]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out = {}
        for rank, ref in zip(ranks, refs, strict=True):
            try:
                out[rank] = ray.get(ref) if ref in ready else f"no answer within {timeout_s:g} s (stopped or wedged)"
            except RayError as e:
                out[rank] = f"no answer: {first_line(e)}"
        return out

    def request_stop(self, deadline: float) -> None:
        for w in self.workers:
            w.request_stop.remote(deadline)

    # -- replacing ------------------------------------------------------------------------------

    def recover_with(self, health_check: Fn | None, abort_collectives: Fn | None) -> None:
        """What `release_unhealthy` runs in a rank's process, beside its call: `health_check`, true if the
        process can still work (on GPUs a real device operation: after a sticky CUDA error a process still
        answers pings, then fails every attempt); `abort_collectives`, which ends the collectives a still
        running call waits in and says whether that call now returns (NCCL ranks whose peer died wait there
        for the whole collective timeout, and would be killed)."""
        self.health_check, self.abort_collectives = health_check, abort_collectives

    def release_unhealthy(self, timeout_s: float = 5.0) -> None:
        """After a failure: kill every actor whose call did not return (dead, or stuck in a
        collective) or that fails its health check (without one: no longer answers, as a rank that
        raised as its node went down); the others stay, alive and with their imports warm, for
        `refill`. Ranks whose call still runs are first asked to abort their collectives, and those
        whose call then returns are judged like the others. Each of the waits takes timeout_s at most."""
        if self.abort_collectives is not None and self.calls:
            ranks = set(self.calls.values())
            asked = {rank: self.workers[rank].call.remote(self.abort_collectives) for rank in ranks}
            ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=timeout_s)
            freed = set()
            for rank, ref in asked.items():
                with contextlib.suppress(RayError):
                    if ref in ready and ray.get(ref):
                        freed.add(rank)
            deadline = time.monotonic() + timeout_s
            while freed & set(self.calls.values()) and time.monotonic() < deadline:
                self.poll(deadline - time.monotonic())  # their calls' errors are the abort's: only `returned` counts
        pings = {
            rank: self.workers[rank].call.remote(self.health_check)
            if self.health_check is not None
            else self.workers[rank].node_info.remote()
            for rank in self.returned
        }
        ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=timeout_s)
        for rank, ref in pings.items():
            try:
                alive = ref in ready and bool(ray.get(ref))
            except RayError:
                alive = False
            if not alive:
                self.returned.discard(rank)
        kill.end([self.workers[e["rank"]] for e in self.table if e["rank"] not in self.returned])  # dead on return

    def refill(self) -> list[dict]:
        """Workers in place of those `release_unhealthy` let go (Roster.refill); the rank table."""
        self.calls = {}
        return self.roster.refill([entry["rank"] for entry in self.table if entry["rank"] not in self.returned])

    def replace(self, rank: int) -> dict:
        """Kill the actor of `rank` and put another (a hot spare if one is warm) under the same rank:
        for work that goes on without it meanwhile (a parameter server's other workers)."""
        self.calls = {ref: r for ref, r in self.calls.items() if r != rank}
        return self.roster.replace(rank)

    # -- ending -----------------------------------------------------------------------------------

    def release(self) -> None:
        """Keep the roster (its placement group and warm actors) for the next run of the same spec in this
        driver (cluster.reuse_workers): its workers then start in no time. This group is left with none."""
        self.calls, self._asked, self._progress, self.returned = {}, {}, {}, set()
        warm.keep(self.roster)
        self.roster = Roster(self.spec)

    def shutdown(self) -> None:
        self.roster.shutdown()
        self.calls = {}


def answers(refs: dict[int, Any], timeout_s: float) -> dict[int, Any]:
    """rank → the value of its call, for the calls that return within timeout_s (all waited for at once)."""
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    out = {}
    for rank, ref in refs.items():
        if ref in ready:
            with contextlib.suppress(RayError):
                out[rank] = ray.get(ref)
    return out
