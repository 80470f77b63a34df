"""For `--plan`: which failures a layout survives at the cost of the step in flight, from its live replicas'
memory (the recovery itself: driver/collective.py and train/state.py), and which restart from the checkpoint."""

from __future__ import annotations

from distrain.strategy.layout import Layout


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
