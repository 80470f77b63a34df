"""The roster of a worker group: its placement group, the worker actors in rank order and where each runs
(the rank table), and its hot spares. It starts them, refills the places of workers that were let go (hot
spares first), and restocks the spares; what runs on the workers is the worker group's (worker_group.py).

A roster outlives its worker group when the driver keeps it for its next run of the same spec
(cluster.reuse_workers, warm.keep): the next group takes it whole, with its actors warm."""

from __future__ import annotations

import contextlib
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from distrain.cluster import kill, warm
from distrain.cluster.attempt import first_line
from distrain.cluster.placement import (
    GroupSpec,
    PlacementError,
    blocks_that_fit,
    check_blocks,
    number_nodes,
    rank_table,
)
from distrain.cluster.worker import RemoteWorker


class Roster:
    def __init__(self, spec: GroupSpec):
        self.spec = spec
        self.pg = None
        self.job = ray.get_runtime_context().get_job_id()
        self.workers: list = []  # in rank order once started
        self.table: list[dict] = []
        self.spares: list[warm.Spare] = []
        self.free_bundles: list[int] = []  # spare bundles whose spare took a rank, and dead ranks' slots
        self.reserved_at: float | None = None  # when its start found its placement group ready

    # -- starting -------------------------------------------------------------------------------

    def start(self, patient: bool = False) -> list[dict]:
        """Reserve one bundle per block of node_group workers (and one per spare), start the actors,
        then rank them by where they landed; on any failure remove what was reserved and started. A
        group the alive nodes could never hold fails at once, unless `patient` (waiting for nodes to
        come back)."""
        try:
            return self._start(patient)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, patient: bool) -> list[dict]:
        s = self.spec
        bundle, blocks = s.bundle(), s.num_workers // s.node_group
        what = f"{s.num_workers} workers" + (f" in blocks of {s.node_group} per node" if s.node_group > 1 else "")
        fits = blocks_that_fit(bundle)
        if sum(fits.values()) < blocks and not patient:
            raise PlacementError(
                f"cannot place {what}: each block needs {bundle} on one node, and the nodes hold {fits} blocks "
                f"({sum(fits.values())} < {blocks}); use fewer workers or a smaller tensor-parallel size"
            )
        warm.make_room(self.resources())
        self.pg = placement_group(s.bundles(), strategy=s.placement_strategy)
        # The actors are asked for at once: Ray starts each as soon as its bundle is reserved.
        of_rank = [i // s.node_group for i in range(s.num_workers)]
        actors = [self._actor(b) for b in of_rank]
        self.workers = actors  # shutdown finds them, even if the next lines fail
        try:
            ray.get(self.pg.ready(), timeout=s.placement_timeout_s)
        except GetTimeoutError as e:
            raise PlacementError(
                f"could not place {what} ({bundle} per bundle) within "
                f"cluster.placement_timeout_s={s.placement_timeout_s:g}; the cluster has "
                f"{ray.available_resources()} free"
            ) from e
        self.reserved_at = time.time()
        self.free_bundles = [blocks + i for i in range(s.spares)]  # spares start once a step is done: `restock`
        return self._rank(actors, self._started(actors, of_rank))

    def _started(self, actors: list, bundles: list[int]) -> list[dict]:
        """Where each new actor runs, once it has started (slow: a process, perhaps a runtime env)."""
        try:
            infos = ray.get([w.node_info.remote() for w in actors], timeout=self.spec.start_timeout_s)
        except (GetTimeoutError, RayActorError) as e:  # its node died between reservation and start
            raise PlacementError(f"{len(actors)} workers were placed but did not start: {first_line(e)}") from e
        return [dict(info, bundle=bundle) for info, bundle in zip(infos, bundles, strict=True)]

    def _actor(self, bundle: int):
        s = self.spec
        return RemoteWorker.options(
            num_cpus=s.cpus_per_worker,
            num_gpus=s.gpus_per_worker,
            max_concurrency=2,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
        ).remote()

    def _rank(self, actors: list, infos: list[dict]) -> list[dict]:
        """Order the actors by where they landed (rank_table); each info names its bundle."""
        self.table = rank_table(infos, self.spec.node_group)
        self.workers = [actors[entry["worker_index"]] for entry in self.table]
        return self.table

    def placement(self) -> list[dict]:
        """Where the ranks run, then the spares that are warm: for the run directory's placement files."""
        spares = [{"spare": i, **info} for i, sp in enumerate(self.spares) if (info := sp.info()) is not None]
        return [*self.table, *spares]

    # -- refilling ------------------------------------------------------------------------------

    def refill(self, lost: list[int]) -> list[dict]:
        """Put workers in place of the ranks `lost` (their workers let go), hot spares first, each under the rank
        it takes: the kept workers keep theirs. (A process whose rank changes between two process groups trips
        torch's device-mesh caches: its new mesh's collectives resolve to the old group names, "Could not
        resolve the process group"; and a kept worker holds its own rank's state for recovery from replicas.)
        PlacementError if new ones are needed and the placement group is not whole again within
        placement_timeout_s (a node of it is gone and nothing took its place), or if a replacement landed where
        a block of node_group ranks would span two nodes."""
        self._fill(lost)
        check_blocks(self.table, self.spec.node_group)
        return self.table

    def replace(self, rank: int) -> dict:
        """Kill the actor of `rank` and put another (a hot spare if one is warm) under the same rank."""
        ray.kill(self.workers[rank], no_restart=True)
        self._fill([rank])
        return self.table[rank]

    def _fill(self, ranks: list[int]) -> None:
        """An actor under each of `ranks` (lost): a warm spare where one can take it (on the rank's node when
        its block must share one), else a new actor in the rank's bundle; the table updated where they run."""
        new = []
        for rank in ranks:
            entry = self.table[rank]
            taken = warm.take_spare(self.spares, entry["node_id"] if self.spec.node_group > 1 else None)
            if taken is None:
                new.append(rank)
                continue
            spare, info = taken
            self.workers[rank], self.table[rank] = spare.actor, {**entry, **info}
            self.free_bundles.append(entry["bundle"])  # where the next spare goes
        if new:
            bundles = [self.table[r]["bundle"] for r in new]
            actors, infos = self._start_in(bundles, f"could not restart {len(new)} workers")
            for rank, actor, info in zip(new, actors, infos, strict=True):
                self.workers[rank], self.table[rank] = actor, {**self.table[rank], **info}
        number_nodes(self.table)  # they may have come up on other nodes or GPUs

    def _start_in(self, bundles: list[int], what: str) -> tuple[list, list[dict]]:
        """New actors in `bundles` of the placement group, started, and where they run. A node that has just
        died still holds its bundles until Ray marks it dead (its heartbeats missed, seconds later): actors
        placed there meanwhile are cancelled. Then once the group is whole again they are placed anew, within
        placement_timeout_s; the kept workers, and the state they hold, wait meanwhile."""
        deadline = time.monotonic() + self.spec.placement_timeout_s
        while True:
            self._wait_whole(what)
            actors = [self._actor(b) for b in bundles]
            try:
                return actors, self._started(actors, bundles)
            except PlacementError:
                for actor in actors:
                    with contextlib.suppress(RayError):
                        ray.kill(actor, no_restart=True)
                if time.monotonic() > deadline:
                    raise

    def restock(self, warm_up: warm.WarmUp | None) -> None:
        """Start a spare in each free spare bundle, warming up with `warm_up`: at first, and where a spare left
        when it took a rank (a run calls this once its attempt has made a step: a spare's warm-up takes CPU the
        start needs more)."""
        while self.free_bundles and len(self.spares) < self.spec.spares:
            self.spares.append(warm.start_spare(self._actor, self.free_bundles.pop(), warm_up))
        self.free_bundles.clear()

    def _wait_whole(self, what: str) -> None:
        """Until the placement group is whole again (a lost node's bundles rescheduled), or PlacementError: not
        within placement_timeout_s, or the group is gone (the supervisor then places a new one)."""
        try:
            ray.get(self.pg.ready(), timeout=self.spec.placement_timeout_s)
        except GetTimeoutError as e:
            raise PlacementError(
                f"{what}: their placement group lost a node and was not whole again within "
                f"cluster.placement_timeout_s={self.spec.placement_timeout_s:g}"
            ) from e
        except RayError as e:  # TaskPlacementGroupRemoved
            raise PlacementError(f"{what}: their placement group is gone ({first_line(e)})") from e

    # -- ending, and as a warm.Kept group -------------------------------------------------------

    @property
    def key(self) -> GroupSpec:
        return self.spec

    @property
    def actors(self) -> list:
        return self.workers

    def resources(self) -> dict[str, float]:
        """What its placement group reserves, spares' bundles included."""
        reserved: dict[str, float] = {}
        for bundle in self.spec.bundles():
            for k, v in bundle.items():
                reserved[k] = reserved.get(k, 0) + v
        return reserved

    def shutdown(self) -> None:
        kill.end([*self.workers, *(spare.actor for spare in self.spares)])
        self.workers, self.spares = [], []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
