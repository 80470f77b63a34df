"""For `--plan`: which failures a layout survives at the cost of the step in flight, from its live replicas'
memory (the recovery itself: driver/collective.py and train/state.py), and which restart from the checkpoint."""

from __future__ import annotations

from distrain.cluster.places import RankPlace
from distrain.strategy.layout import Layout


def survivable(layout: Layout, table: list[RankPlace], peer_recovery: bool = True) -> list[str]:
    """For `--plan`: which failures of this layout on these placed workers (`table`, in rank order) cost only
    the step in flight, and which a restart from the checkpoint."""
    if not peer_recovery:
        return ["failures: every one restarts from the last checkpoint (cluster.peer_recovery=false)"]
    copies = replica_groups(layout)
    replicas = len(copies[0])
    if replicas < 2:
        borrowed = f" (expert parallelism, ep={layout.ep}, borrows them)" if layout.dp_replicate > 1 else ""
        return [
            f"failures: no data-parallel replica (dp_replicate={layout.dp_replicate}){borrowed}: every one restarts "
            "from the last checkpoint; with dp_replicate ≥ 2 one costs only the step in flight"
        ]
    members = "; ".join(f"replica {i}: {_ranks([g[i] for g in copies])}" for i in range(replicas))
    lines = [
        f"failures: any {replicas - 1} rank{'s' * (replicas > 2)} lost cost only the step in flight, from the "
        f"others' memory ({members}); every copy of a shard lost: a restart from the last checkpoint"
    ]
    nodes: dict[str, list[int]] = {}
    for entry in table:
        nodes.setdefault(entry.node_id, []).append(entry.rank)
    if len(nodes) > 1:
        for node, ranks in nodes.items():
            left = set(range(layout.world_size)) - set(ranks)
            whole = all(set(group) & left for group in copies)
            ip = next(e.node_ip for e in table if e.node_id == node)
            lines.append(
                f"  node {ip} lost ({_ranks(sorted(ranks))}): "
                + ("the step in flight" if whole else "a restart from the last checkpoint")
            )
    return lines


def replica_groups(layout: Layout) -> list[list[int]]:
    """The ranks holding each shard of the training state (Layout.shard_of): data-parallel replicas, less
    those expert parallelism gave other experts."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(layout.world_size):
        groups.setdefault(layout.shard_of(rank), []).append(rank)
    return list(groups.values())


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
