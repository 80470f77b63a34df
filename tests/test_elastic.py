"""Elastic training on a simulated multi-node cluster (`ray.cluster_utils.Cluster`): a run that
loses a node shrinks to the largest layout the survivors hold and goes on from its last committed
checkpoint (resharded by DCP), grows back at a checkpoint when nodes return, and checkpoints and
moves off a node that is being drained (a spot preemption notice) before the node is taken. The
same global batch throughout, so its losses are those of an uninterrupted run.

One process can join only one Ray cluster and the session's tests share an embedded one, so the
scenario runs in a subprocess (this file run as a script) that writes its results as JSON; one
Cluster serves both the reference run and the elastic one.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported, also when run as a script:
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # the cluster binds 127.0.0.1 only and phones nobody

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import (  # noqa: E402
    assert_recovery_in_order,
    attempt_placement,
    committed_step,
    final_weights,
    logged,
    logged_step,
    make_config,
)
from test_placement import _alive, _descendants, run_script  # noqa: E402

from distrain.storage.tracking import read_metrics  # noqa: E402

# Held at each attempt's first step, the run makes its four attempts by step ~12 whatever the machine's speed
# (each resumes at the previous one's last step, or at the checkpoint before a loss); the last trains the rest.
STEPS = 24
CHECKPOINT_EVERY = 3
REMOVE_AT = 8  # the step after which a node is taken away
# Global batch 8 in micro-batches of 2 (conftest's TINY): 4 workers accumulate once, 2 workers
# twice; 3 workers cannot split the batch, so the run shrinks from 4 straight to 2.
COMMON = (
    "cluster.num_workers=4",
    "cluster.min_workers=2",
    "cluster.cpus_per_worker=1",  # one 2-CPU node holds 2 workers
    "cluster.placement_timeout_s=3",
    "cluster.restart_backoff_s=0",
    "cluster.node_check_s=1",
    "cluster.reuse_workers=false",  # the point is new placements
    f"checkpoint.interval={CHECKPOINT_EVERY}",
    f"trainer.max_steps={STEPS}",
)
# A lost node is declared dead after ~1.4 s instead of Ray's default ~16 s.
FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 2,
}
# The reference: the same training in one process (one fresh worker to start, not four).
ONE_WORKER = ("cluster.num_workers=1", "cluster.min_workers=1")
# The two runs differ only in the order of their sums (all-reduce over 4 or 2 ranks, 1, 2 or 4
# accumulated micro-batches): in fp32 the losses moved by at most 5e-7 here (test_training asks
# 1e-5 of the same layouts). 1e-4 leaves room for that and still catches any real slip: a step lost
# or trained twice, batches read from the wrong place, a wrong accumulation scale or optimizer state
# lost in resharding each move the loss by 1e-2 or more.
TOLERANCE = 1e-4


@pytest.mark.timeout(480)
def test_a_run_shrinks_on_node_loss_grows_back_and_moves_off_a_draining_node(tmp_path: Path):
    code, out, err = run_script(__file__, str(tmp_path), timeout_s=420)
    reference = make_config(tmp_path, "run.name=reference", *COMMON, *ONE_WORKER, *_held(tmp_path))
    elastic = make_config(tmp_path, "run.name=elastic", *COMMON, *_held(tmp_path))
    run_dir = Path(elastic.run_dir)
    assert code == 0, _diagnosis(run_dir, out, err)
    results = json.loads((tmp_path / "results.json").read_text())
    events = results["events"]

    assert [(a["world_size"], a["outcome"]) for a in results["reference"]["attempts"]] == [(1, "completed")]
    summary = results["elastic"]
    assert summary["status"] == "completed" and summary["final_step"] == STEPS
    # Lost a node at step ~8 (failed), ran on the 2 workers the surviving node holds until two nodes
    # came back (resized), ran on 4 until one of their nodes was drained (resized), then finished
    # on 4 workers on the other two nodes (completed).
    attempts = summary["attempts"]
    assert [(a["world_size"], a["outcome"]) for a in attempts] == [
        (4, "failed"),
        (2, "resized"),
        (4, "resized"),
        (4, "completed"),
    ], json.dumps(attempts, indent=1)
    assert summary["restarts"] == 3
    placements = [attempt_placement(run_dir, a["number"]) for a in attempts]
    nodes = [{e["node_id"] for e in table} for table in placements]
    lost, drained = events["removed_node"], events["drained_node"]

    # The node loss: the failing rank lived on the removed node; it was seen within seconds.
    lost_rank = int(re.match(r"rank (\d+) ", attempts[0]["cause"]).group(1))
    assert placements[0][lost_rank]["node_id"] == lost, attempts[0]["cause"]
    assert "ActorDiedError" in attempts[0]["cause"] or "ActorUnavailableError" in attempts[0]["cause"]
    assert attempts[0]["timings"]["ended_at"] - events["removed_at"] < 10
    # The shrunk attempt resumed from the newest checkpoint committed before the loss, or one the
    # ranks committed a moment later (written in the background). The lost ranks may still have
    # trained and logged a few steps (their processes notice the dead raylet a moment later), not
    # more than two checkpoint intervals (a save waits for the previous one's commit): their log lines
    # after the checkpoint were set aside, and are the only ones (the later resumptions start from a
    # checkpoint taken at the previous attempt's last step).
    resumed = attempts[1]["info"]["resumed_from_step"]
    assert events["removed_step"] >= REMOVE_AT
    assert resumed % CHECKPOINT_EVERY == 0 and resumed >= events["committed_step"], (resumed, events)
    aside = run_dir / "metrics.superseded.jsonl"  # absent if the node went just after a checkpoint
    superseded = [json.loads(line)["step"] for line in (aside.read_text().splitlines() if aside.exists() else [])]
    assert superseded == list(range(resumed + 1, resumed + 1 + len(superseded))), (resumed, superseded)
    assert len(superseded) <= 2 * CHECKPOINT_EVERY, (resumed, superseded)
    assert lost not in nodes[1] and nodes[1] <= nodes[0]
    assert attempts[1]["step_reached"] > resumed
    # The recovery is recorded phase by phase, from the failure to the first step on 2 workers.
    recovery = attempts[1]["recovery"]
    assert set(recovery) == {
        "teardown_s",
        "placement_s",
        "process_group_s",
        "checkpoint_load_s",
        "first_step_s",
        "total_s",
    }
    # Its marks in order, from after the node went to before the first step's metrics line.
    logged_at = next(m["time"] for m in read_metrics(str(run_dir)) if m["step"] == resumed + 1)
    assert_recovery_in_order(attempts[1]["timings"], events["removed_at"], logged_at)
    # Growing back: at a checkpoint taken on request, onto 4 workers that avoid the lost node.
    assert attempts[2]["info"]["resumed_from_step"] == attempts[1]["step_reached"]
    assert lost not in nodes[2] and len(placements[2]) == 4
    # Draining: the run checkpointed on request and moved off the node before it was taken; the node
    # then left the cluster by itself, nothing of the run's left on it.
    assert events["drain_accepted"] and drained in nodes[2]
    assert attempts[2]["step_reached"] > attempts[2]["info"]["resumed_from_step"]
    assert attempts[3]["info"]["resumed_from_step"] == attempts[2]["step_reached"]
    assert drained not in nodes[3] and lost not in nodes[3] and len(placements[3]) == 4
    assert results["alive"][drained] is False and results["alive"][lost] is False
    assert attempts[2].get("cause") is None and attempts[3].get("cause") is None  # neither was a failure
    said = [line.removeprefix("distrain: ") for line in out.splitlines() if line.startswith("distrain: ")]
    assert any(line.startswith("continuing on 2 of 4 workers") for line in said), said
    assert any(line.startswith("room for all 4 workers again") for line in said), said
    assert any(line.startswith(f"node {drained[:8]} is draining") for line in said), said

    # Every step logged once (the lines of steps trained again were set aside, above), losses and
    # gradient norms step by step and the final weights as the uninterrupted run's.
    steps = [m["step"] for m in read_metrics(str(run_dir))]
    assert steps == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        want, got = logged(reference, key), logged(elastic, key)
        for step in range(1, STEPS + 1):
            assert got[step] == pytest.approx(want[step], abs=TOLERANCE, rel=TOLERANCE), f"{key} at step {step}"
    want, got = final_weights(reference), final_weights(elastic)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=TOLERANCE, rtol=0, msg=name)

    # Every process the cluster started has ended, those of the lost node included.
    assert results["pids"], "the cluster's processes were not found"
    deadline = time.monotonic() + 10  # workers whose raylet is gone exit on their own, soon
    while (alive := [pid for pid in results["pids"] if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive == [], f"processes left behind: {alive}"


def _diagnosis(run_dir: Path, out: str, err: str) -> str:
    """What the supervisor said and recorded, and the end of the scenario's own log, without Ray's
    state dumps."""
    said = [line for line in out.splitlines() if line.startswith("distrain: ")]
    log = [line for line in err.splitlines() if "[state-dump]" not in line and line.strip()]
    try:
        attempts = json.loads((run_dir / "summary.json").read_text())["attempts"]
        recorded = [{k: a.get(k) for k in ("world_size", "outcome", "cause", "step_reached", "info")} for a in attempts]
    except (FileNotFoundError, ValueError, KeyError):
        recorded = "no summary.json"
    return "\n".join([*said, f"attempts: {json.dumps(recorded)}", *log[-40:]])


# -- the scenario, run as a script ----------------------------------------------------------------


def _held(storage: Path) -> list[str]:
    """While this file exists, every rank waits before its next step: the scenario holds the run at
    each attempt's first step until it has made the change the attempt is to notice (a grow, a drain),
    so no attempt can end before the supervisor sees it, whatever the machine's speed."""
    return [f"fault.hold_file={storage / 'hold'}"]


def _wait_for(what: str, predicate, trainer: threading.Thread, timeout_s: float = 180.0):
    """predicate()'s first true value; an error if the training thread ends first, or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if not trainer.is_alive():
            raise RuntimeError(f"the run ended before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what}")
        time.sleep(0.05)
    return value


def _free_cpus(n: float, timeout_s: float = 60.0) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster never had {n:g} CPUs free: {ray.available_resources()}")
        time.sleep(0.1)


def main(storage: Path) -> None:
    import ray
    from ray.cluster_utils import Cluster
    from ray.core.generated import autoscaler_pb2

    from distrain.driver.launch import train

    started = time.monotonic()

    def log(*what: object) -> None:
        print(f"[{time.monotonic() - started:6.1f} s]", *what, file=sys.stderr, flush=True)

    node = {"node_ip_address": "127.0.0.1", "object_store_memory": 80 * 2**20, "num_cpus": 2}
    head = {**node, "num_cpus": 0, "include_dashboard": False, "_system_config": FAST_HEALTH_CHECKS}
    cluster = Cluster(initialize_head=True, head_node_args=head)  # the driver's node: no workers there
    results: dict = {}
    pids: set[int] = set()
    try:
        nodes = [cluster.add_node(**node, wait=False) for _ in range(2)]
        ray.init(address=cluster.address, logging_level="WARNING")
        cluster.wait_for_nodes()
        log("2 nodes of 2 CPUs")

        _free_cpus(4)  # every node's resources reported, so the run starts on all 4 workers
        results["reference"] = train(make_config(storage, "run.name=reference", *COMMON, *ONE_WORKER, *_held(storage)))
        log("reference run done")
        _free_cpus(4)  # the reference's workers have given their CPUs back

        cfg = make_config(storage, "run.name=elastic", *COMMON, *_held(storage))
        hold = storage / "hold"
        run_dir, events, outcome = Path(cfg.run_dir), {}, {}

        def run() -> None:  # the cluster changes come from this (the main) thread: Ray's node start needs it
            try:
                outcome["summary"] = train(cfg)
            except BaseException as e:
                outcome["error"] = f"{type(e).__name__}: {e}"

        trainer = threading.Thread(target=run)
        trainer.start()
        try:
            # A node goes, without notice, mid-run: the one holding rank 0 (and the rendezvous).
            _wait_for(f"step {REMOVE_AT}", lambda: logged_step(run_dir) >= REMOVE_AT, trainer)
            hold.write_text("")  # from here on every attempt waits at its first step until released
            pids.update(_descendants(os.getpid()))
            victim = next(n for n in nodes if n.node_id == attempt_placement(run_dir, 1)[0]["node_id"])
            events.update(
                removed_node=victim.node_id,
                removed_step=logged_step(run_dir),
                committed_step=committed_step(run_dir),
                removed_at=time.time(),
            )
            cluster.remove_node(victim, allow_graceful=False)
            log(f"removed node {victim.node_id[:8]} at step {events['removed_step']}")

            # Once the run goes on shrunk, two nodes join: room for all 4 workers, and one spare.
            _wait_for("the shrunk attempt", lambda: attempt_placement(run_dir, 2), trainer)
            nodes += [cluster.add_node(**node, wait=False) for _ in range(2)]
            cluster.wait_for_nodes()
            log("added 2 nodes")

            # Once it has grown back, one of its nodes gets a preemption notice.
            drained = _wait_for("the grown attempt", lambda: attempt_placement(run_dir, 3), trainer)[0]["node_id"]
            pids.update(_descendants(os.getpid()))
            gcs = ray._private.worker.global_worker.gcs_client
            reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
            accepted, _ = gcs.drain_node(drained, reason, "spot preemption", int(time.time() * 1000) + 60_000)
            events.update(drained_node=drained, drain_accepted=accepted, drained_at=time.time())
            log(f"draining node {drained[:8]}: accepted={accepted}")

            # Once it has moved off the draining node, the run may finish.
            _wait_for("the attempt after the drain", lambda: attempt_placement(run_dir, 4), trainer)
            hold.unlink()
        finally:
            hold.unlink(missing_ok=True)  # also when a step above failed: the run then ends on its own
            trainer.join()
        if "error" in outcome:
            raise RuntimeError(outcome["error"])
        results.update(elastic=outcome["summary"], events=events)
        log("elastic run done")
        results["alive"] = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
        pids.update(_descendants(os.getpid()))
    finally:
        ray.shutdown()
        cluster.shutdown()
    results["pids"] = sorted(pids)
    (storage / "results.json").write_text(json.dumps(results))
    log("cluster shut down")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
