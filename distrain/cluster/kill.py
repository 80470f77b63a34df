"""Ending actors for good: Ray's kill, their handles held until the cluster has them dead."""

from __future__ import annotations

import time
from typing import Any

import ray
from ray._private.state import state  # the actor table: Ray's public reader of it needs the dashboard

DEAD_WITHIN_S = 5.0  # then let go regardless (a GCS that no longer answers, say)


def end(actors: list[Any]) -> None:
    """Kill `actors`: each process ends at once, without Python's teardown. The handles are let go only once
    the cluster has them dead: let go before the kill reached the GCS (Ray does not order the two), they had the
    GCS end the actor its own way ("all references to the actor were removed"): a graceful exit that tears the
    interpreter down with torch's and gloo's threads about, which crashed now and then (a SIGSEGV in
    tstate_delete_common, a double free), its stack on the console after the run had ended."""
    if not actors:
        return
    for actor in actors:
        ray.kill(actor, no_restart=True)
    ids = {actor._actor_id.hex() for actor in actors}
    job, deadline = ray.JobID.from_hex(ray.get_runtime_context().get_job_id()), time.monotonic() + DEAD_WITHIN_S
    while ids and time.monotonic() < deadline:
        table = state.actor_table(None, job_id=job)
        ids = {i for i in ids if i in table and table[i]["State"] != "DEAD"}
        time.sleep(0.01 if ids else 0)
