"""The driver's half of recovery from live replicas (the ranks' half: train/peers.py): after a failure,
whether the ranks still alive hold every shard of the training state between them, and so which rank
sends each rank its state; and, for `--plan`, which failures a layout survives that way."""

from __future__ import annotations

from collections import Counter

from distrain.strategy.layout import Layout
from distrain.train.job import PeerPlan

HELD = "distrain.train.peers:held"  # what each kept worker is asked (named: the driver never imports torch)


def plan_recovery(layout: Layout, held: dict[int, dict | None], run: str, number: int) -> tuple[PeerPlan | None, str]:
    """The plan for the next attempt on `layout`, given what the worker at each rank keeps from the failed
    one (`held`: rank → train.peers.held(), None or absent for a new worker), or None; and the line that
    says so. Every rank takes its state at the newest step any survivor reached: from its own memory when
    it holds its shard at that step, else from one that does, the sending spread over them."""
    kept = {r: h for r, h in held.items() if h and h["run"] == run and h["world"] == layout.world_size}
    if not kept:
        return None, "no surviving rank kept a whole training state"
    step = max(h["step"] for h in kept.values())
    have: dict[tuple, list[int]] = {}
    for r, h in sorted(kept.items()):
        if h["step"] == step:
            have.setdefault(layout.shard_of(h["rank"]), []).append(r)
    for r in range(layout.world_size):
        if layout.shard_of(r) not in have:
            return None, f"no surviving rank holds rank {r}'s shard ({shard_name(layout, r)}) at step {step}"
    sources, sending = [], Counter()
    for r in range(layout.world_size):
        holders = have[layout.shard_of(r)]
        source = r if r in holders else min(holders, key=lambda h: (sending[h], h))
        sending[source] += source != r
        sources.append(source)
    lines = {s: line for h in kept.values() if h and h["step"] == step for s, line in h["lines"].items()}
    moves = ", ".join(f"rank {r} from rank {s}" for r, s in enumerate(sources) if r != s)
    return (
        PeerPlan(run, step, tuple(sources), number, lines),
        f"from the live replicas' memory at step {step}, no checkpoint read ({moves or 'each rank its own'})",
    )


def shard_name(layout: Layout, rank: int) -> str:
    return ", ".join(f"{k} {v}" for k, v in layout.coordinate(rank).items() if k != "dp_replicate")


def survivable(layout: Layout, table: list[dict], peer_recovery: bool = True) -> list[str]:
    """For `--plan`: which failures of this layout on these placed workers (`table`, in rank order) cost only
    the step in flight, and which a restart from the checkpoint."""
    if not peer_recovery:
        return ["failures: every one restarts from the last checkpoint (cluster.peer_recovery=false)"]
    replicas = layout.dp_replicate
    if replicas < 2:
        return [
            "failures: no data-parallel replica (dp_replicate=1): every one restarts from the last checkpoint; "
            "with dp_replicate ≥ 2 one costs only the step in flight"
        ]
    copies = layout.groups("dp_replicate")
    members = "; ".join(f"replica {i}: {_ranks([g[i] for g in copies])}" for i in range(replicas))
    lines = [
        f"failures: any {replicas - 1} rank{'s' * (replicas > 2)} lost cost only the step in flight, from the "
        f"others' memory ({members}); every copy of a shard lost: a restart from the last checkpoint"
    ]
    nodes: dict[str, list[int]] = {}
    for entry in table:
        nodes.setdefault(entry["node_id"], []).append(entry["rank"])
    if len(nodes) > 1:
        for node, ranks in nodes.items():
            left = set(range(layout.world_size)) - set(ranks)
            whole = all(set(group) & left for group in copies)
            ip = next(e["node_ip"] for e in table if e["node_id"] == node)
            lines.append(
                f"  node {ip} lost ({_ranks(sorted(ranks))}): "
                + ("the step in flight" if whole else "a restart from the last checkpoint")
            )
    return lines


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' * (len(ranks) > 1)} {_ranges(ranks)}"


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] as '0-2, 5'."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)
