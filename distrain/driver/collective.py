"""Collective training as an engine of the supervisor (the parameter server's: distrain/ps/engine.py), and the
rules of where each attempt starts: from the live replicas' memory when the ranks still alive hold every shard
of the training state between them (and which rank sends each rank its state), else from the newest committed
checkpoint, else fresh. The ranks' half of a start: train/state.py."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from distrain.cluster.attempt import Attempt
from distrain.cluster.states import Work
from distrain.cluster.worker_group import WorkerGroup
from distrain.driver.rerun import newest_checkpoint
from distrain.strategy.layout import Layout
from distrain.train.job import FRESH, FromCheckpoint, FromReplicas, RankJob, Start

# The workers' functions, named rather than imported: they import torch, which the driver never needs
# (seconds of its start, on the path to the first step).
TRAINER, PROCESS_GROUP = "distrain.train.rank", "distrain.parallel.process_group"
OFFER = "distrain.train.replicas:offer"  # what each kept worker is asked: the state it keeps, in plain data


class AllReduceEngine:
    """Every rank runs `train.rank.run_rank` in one process group; a failure restarts the group, on the layout of
    its size, from where `start_from_replicas` or the newest committed checkpoint says."""

    replaces_workers = False

    def __init__(self, job: RankJob, layouts: dict[int, Layout], say: Callable[[str], None] = print):
        """`say`: the driver's lines (a restart waiting for the run's object store)."""
        self.job, self.layouts, self.run_dir, self.say = job, layouts, Path(job.run_dir), say
        self.recoveries = 0  # from replicas, so far
        self.replicas_offered = False  # from_replicas found every shard held: the next `begin` starts from them

    def from_replicas(self, group: WorkerGroup) -> tuple[bool, str]:
        if not self.job.config.cluster.peer_recovery:
            return False, ""
        offers = group.ask(OFFER, sorted(group.returned), timeout_s=2.0)
        start, why = start_from_replicas(self.layouts[len(group.table)], offers, self.job.run_id, self.recoveries + 1)
        self.replicas_offered = start is not None
        return start is not None, why

    def warm_up(self) -> tuple[str, tuple]:
        return f"{TRAINER}:warm_up", (self.job.config,)

    def begin(self, group: WorkerGroup, attempt: Attempt) -> Work:
        """The attempt's work; and what the group runs in the ranks after a failure: an abort of the
        collectives that ranks whose peer died wait in (on NCCL they would wait out the collective timeout,
        then be killed), and a check on the device before a process is kept."""
        group.recover_with(f"{PROCESS_GROUP}:check_device", f"{PROCESS_GROUP}:abort")
        layout = self.layouts[len(group.table)]
        start, note = self.start(group, layout, attempt)
        job = replace(self.job, layout=layout, start=start, use_gpu=group.spec.gpus_per_worker > 0)  # a GPU: used
        return Work(f"{TRAINER}:run_rank", (job,), note=note)

    def start(self, group: WorkerGroup, layout: Layout, attempt: Attempt) -> tuple[Start, str]:
        """Where the attempt starts, recorded in its info, and the line that says so when it is a restart."""
        note = ""
        if self.replicas_offered:  # asked again: the group was refilled and ranked anew
            self.replicas_offered = False
            replicas, why = start_from_replicas(layout, group.ask(OFFER), self.job.run_id, self.recoveries + 1)
            if replicas is not None:
                self.recoveries += 1
                attempt.info.update(resumed_from_step=replicas.step, resumed_from="replicas")
                return replicas, ""
            note = f"restarting from the last checkpoint after all: {why}"
        latest, meta = newest_checkpoint(self.job.config, self.run_dir, self.say)
        attempt.info["resumed_from_step"] = meta.get("step", 0)
        if attempt.number > 1:  # a restart: from where, said (the first attempt's resume is the summary's)
            where = f"the checkpoint of step {meta['step']}" if latest else "step 0 (no checkpoint committed yet)"
            note = "; ".join(filter(None, [note, f"attempt {attempt.number} starts from {where}"]))
        return (FromCheckpoint(str(latest)) if latest else FRESH), note

    def tick(self, suspect: bool) -> None:
        pass

    def replaced(self, rank: int) -> None:
        raise AssertionError("a process group restarts together")

    def request_stop(self, deadline: float) -> None:
        pass

    def finish(self, results: list[Any]) -> dict:
        return results[0]  # rank 0's record of the run

    def end(self, keep: bool = False) -> None:
        pass


def start_from_replicas(
    layout: Layout, offers: dict[int, dict | None], run: str, number: int
) -> tuple[FromReplicas | None, str]:
    """The start of the next attempt on `layout` from the state the worker at each rank keeps from the failed
    one (`offers`: rank → train.replicas.offer(), None or absent for a new worker), or None; and the line that
    says so. Every rank takes its state at the newest step any survivor reached: from its own memory when
    it holds its shard at that step, else from one that does, the sending spread over them."""
    kept = {r: o for r, o in offers.items() if o and o["run"] == run and o["world"] == layout.world_size}
    if not kept:
        return None, "no surviving rank kept a whole training state"
    step = max(o["step"] for o in kept.values())
    have: dict[tuple, list[int]] = {}
    for r, o in sorted(kept.items()):
        if o["step"] == step:
            have.setdefault(layout.shard_of(o["rank"]), []).append(r)
    for r in range(layout.world_size):
        if layout.shard_of(r) not in have:
            return None, f"no surviving rank holds rank {r}'s shard ({shard_name(layout, r)}) at step {step}"
    sources, sending = [], Counter()
    for r in range(layout.world_size):
        holders = have[layout.shard_of(r)]
        source = r if r in holders else min(holders, key=lambda h: (sending[h], h))
        sending[source] += source != r
        sources.append(source)
    lines = {s: line for o in kept.values() if o["step"] == step for s, line in o["lines"].items()}
    moves = ", ".join(f"rank {r} from rank {s}" for r, s in enumerate(sources) if r != s)
    return (
        FromReplicas(run, step, tuple(sources), number, lines),
        f"from the live replicas' memory at step {step}, no checkpoint read ({moves or 'each rank its own'})",
    )


def shard_name(layout: Layout, rank: int) -> str:
    return ", ".join(f"{k} {v}" for k, v in layout.coordinate(rank).items() if k != "dp_replicate")
