"""Recovery from a live replica, the transfer: a failure costs the step in flight, not the steps since the last
checkpoint.

When an attempt fails, each rank whose state is whole (the failure came between two optimizer updates,
not inside one) keeps it in its process: references to its model and optimizer tensors, no copy
(`keep`). The next attempt's ranks build a fresh model and optimizer on the new process group and fill
them (`fill`): a rank from its own memory, or, when its own is gone (the replacement of a dead rank) or
behind, from a rank of another data-parallel replica holding the same shard, sent point to point over
the new group. A digest of every shard, compared across its replicas afterwards (`check_replicas`),
shows the copies equal bit for bit. The driver decides who sends what (driver/collective.py); the rank's
state and its sources: train/state.py. No checkpoint is read.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class ReplicaMismatchError(RuntimeError):
    """After a recovery from replicas, two replicas of one shard differ: their state cannot be trusted."""


@dataclass
class KeptState:
    """A rank's training state kept in its process after its attempt failed, for the next attempt to start from."""

    run: str
    rank: int  # in the attempt that failed
    world: int
    step: int  # the last step whose optimizer update finished
    # Flat, as the trainer's checkpoint state: key → the live tensor's local shard. Never a DTensor: one would keep
    # the failed attempt's device mesh alive, and torch's mesh cache would hand its dead groups to the next one.
    state: dict
    extras: dict  # what else a replacement takes from its source: RNG states, the last loss
    lines: dict[int, dict]  # the last logged steps read back here (step → metrics): rank 0 may not have written them


_kept: KeptState | None = None


def keep(kept: KeptState | None) -> None:
    """What this process keeps for the next attempt (None: nothing; the last kept state is let go)."""
    global _kept
    _kept = kept


def offer() -> dict | None:
    """What this process keeps from its last attempt, for the driver's plan (run by the worker, in plain data)."""
    k = _kept
    return None if k is None else {"run": k.run, "rank": k.rank, "world": k.world, "step": k.step, "lines": k.lines}


def kept_at(run: str, step: int) -> KeptState | None:
    """The kept state if it is `run`'s at `step` (it stays kept until the attempt is under way: `keep(None)`)."""
    k = _kept
    return k if k is not None and (k.run, k.step) == (run, step) else None


def flatten(state: dict) -> dict:
    """The trainer's state ({"model": {...}, "optim": {...}}) as one flat dict."""
    return {f"{part}/{key}": value for part, values in state.items() for key, value in values.items()}


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def tensors(state: dict) -> list[tuple[str, torch.Tensor]]:
    """The state's tensors (each rank's local shard of a DTensor) in one order every rank agrees on."""
    return sorted(((k, local(v)) for k, v in state.items() if isinstance(v, torch.Tensor)), key=lambda kv: kv[0])


def fill(state: dict, sources: tuple[int, ...], rank: int, own: KeptState | None, midway: Callable[[], None]) -> dict:
    """Fill `state` (the fresh model's and optimizer's tensors, flat) for `rank`: from `own` memory when the plan
    names the rank its own source, else from its source's; then send it to the ranks that take theirs from this
    one. Returns the extras this rank now holds (its own, or its source's). `midway` runs once the first
    message has gone or come (a fault injected there)."""
    source = sources[rank]
    if source == rank:
        if own is None:
            raise RuntimeError(f"rank {rank} is named the source of its own state but kept none")
        for key, t in tensors(state):
            t.copy_(local(own.state[key]))
        extras = own.extras
    else:
        extras = _receive(state, source, midway)
    for dest in (d for d, s in enumerate(sources) if s == rank and d != rank):
        _send(state, extras, dest, midway)
    return extras


def _buckets(state: dict) -> list[list[torch.Tensor]]:
    """The state's tensors grouped by dtype and device, each group sent as one message."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for _, t in tensors(state):
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def _send(state: dict, extras: dict, dest: int, midway: Callable[[], None]) -> None:
    blob = torch.frombuffer(bytearray(pickle.dumps(extras)), dtype=torch.uint8)
    dist.send(torch.tensor([blob.numel()], dtype=torch.int64), dest)
    dist.send(blob, dest)
    midway()
    for group in _buckets(state):
        dist.send(torch.cat([t.reshape(-1) for t in group]), dest)


def _receive(state: dict, source: int, midway: Callable[[], None]) -> dict:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, source)
    blob = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(blob, source)
    midway()
    for group in _buckets(state):
        flat = torch.empty(sum(t.numel() for t in group), dtype=group[0].dtype, device=group[0].device)
        dist.recv(flat, source)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
    return pickle.loads(blob.numpy().tobytes())


def digest(state: dict) -> str:
    """A digest of every bit of this rank's shard of the state (its keys too)."""
    h = hashlib.blake2b(digest_size=16)
    for key, t in tensors(state):
        h.update(key.encode())
        h.update(memoryview(t.detach().reshape(-1).view(torch.uint8).cpu().numpy()))
    return h.hexdigest()


def check_replicas(state: dict, shard: tuple[int, ...], step: int) -> None:
    """Collective: every rank's digest of its shard, gathered; ReplicaMismatchError unless the replicas of
    each shard hold the same bits."""
    mine = (shard, digest(state))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    digests: dict[tuple, set[str]] = {}
    for s, d in everyone:
        digests.setdefault(tuple(s), set()).add(d)
    differ = [s for s, ds in digests.items() if len(ds) > 1]
    if differ:
        raise ReplicaMismatchError(
            f"after recovering from replicas at step {step}, the replicas of shard {differ[0]} hold different state"
        )
