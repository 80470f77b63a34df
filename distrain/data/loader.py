"""Batches that are a pure function of (seed, step), the same whatever the number of workers.

The global batch at step k is `global_batch_size` windows of the train split whose offsets are
drawn from a generator seeded with (seed, k). A split is one array of tokens (the byte corpus, in
memory) or several (token shards, memory maps): a window lies within one of them, and only the
windows a rank takes are ever read. A data-parallel rank takes a contiguous slice of
those windows. Nothing is carried from one step to the next, so the loader's whole position is
the step number, and a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from distrain.data.corpus import load_tokens
from distrain.data.remote import local_shards
from distrain.data.shards import open_split

if TYPE_CHECKING:
    from distrain.config import TrainConfig

TRAIN, VAL = 0, 1


@dataclass(frozen=True)
class Split:
    train: np.ndarray
    val: np.ndarray


def split(tokens: np.ndarray, val_fraction: float, seq_len: int) -> Split:
    """Train on the head of the stream, validate on its tail: deterministic and disjoint."""
    n_val = int(len(tokens) * val_fraction)
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    for name, part in (("train", train), ("validation", val)):
        if len(part) <= seq_len + 1:
            raise ValueError(
                f"the {name} split has {len(part)} tokens, too few for trainer.seq_len={seq_len}; "
                f"use more text in data.path or a shorter seq_len"
            )
    return Split(train, val)


class Batches:
    def __init__(
        self,
        tokens: np.ndarray | list[np.ndarray],
        seq_len: int,
        batch_size: int,
        seed: int,
        stream: int = TRAIN,
    ):
        self.parts = tokens if isinstance(tokens, list) else [tokens]  # kept in their own dtype: never widened whole
        self.seq_len, self.batch_size, self.seed, self.stream = seq_len, batch_size, seed, stream
        starts = [max(len(p) - seq_len - 1, 0) for p in self.parts]  # window starts each part offers
        self.first_start = np.cumsum([0, *starts])  # part i's starts are [first_start[i], first_start[i+1])

    def offsets(self, step: int) -> np.ndarray:
        """The global batch's windows, as start positions in the parts laid end to end (without the
        seq_len + 1 tokens ending each, where no window starts)."""
        rng = np.random.default_rng([self.seed, self.stream, step])
        return rng.integers(0, self.first_start[-1], size=self.batch_size)

    def get(self, step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, (batch_size / world, seq_len), for this rank's slice."""
        if self.batch_size % world:
            raise ValueError(f"batch of {self.batch_size} does not split over {world} data-parallel ranks")
        per_rank = self.batch_size // world
        starts = self.offsets(step)[rank * per_rank : (rank + 1) * per_rank]
        part = np.searchsorted(self.first_start, starts, side="right") - 1
        local = starts - self.first_start[part]
        windows = np.stack([self.parts[p][o : o + self.seq_len + 1] for p, o in zip(part, local, strict=True)])
        windows = torch.from_numpy(windows.astype(np.int64))
        return windows[:, :-1], windows[:, 1:]


class Prefetch:
    """A rank's slice of each step's batch, the next step's prepared on a thread while this one computes:
    gathered from the corpus, in pinned host memory on a GPU, then copied without blocking the host, so the
    step never waits on its input. Steps asked for out of order (a parameter-server worker's) are simply
    prepared then."""

    def __init__(self, batches: Batches, shard: tuple[int, int], device: torch.device):
        self.batches, self.shard, self.device = batches, shard, device
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self.ahead: tuple[int, Future] | None = None

    def _load(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batches.get(step, *self.shard)
        return (x.pin_memory(), y.pin_memory()) if self.device.type == "cuda" else (x, y)

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ahead = self.ahead is not None and self.ahead[0] == step
        ready = self.ahead[1] if ahead else self.thread.submit(self._load, step)
        self.ahead = (step + 1, self.thread.submit(self._load, step + 1))
        x, y = ready.result()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


def run_batches(cfg: TrainConfig) -> tuple[Batches, Batches]:
    """A run's training and validation batches: its token shards (from this node's cache when they are on an
    object store), or its byte corpus split in two; its global batch and seed."""
    t = cfg.trainer
    if cfg.data.shards:
        shards = local_shards(cfg)
        train, val = (open_split(shards, name) for name in ("train", "val"))
    else:
        data = split(load_tokens(cfg.data.path), cfg.data.val_fraction, t.seq_len)
        train, val = data.train, data.val
    return (
        Batches(train, t.seq_len, t.global_batch_size, t.seed, TRAIN),
        Batches(val, t.seq_len, t.global_batch_size, t.seed, VAL),
    )
