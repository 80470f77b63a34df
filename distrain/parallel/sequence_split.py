"""Which tokens of every sequence one context-parallel rank holds, as tensors: the cp pass
(context_parallel.py) makes it, ParallelModel cuts each batch by it, the model reads its positions. A
module of its own, so that the passes' context (passes.py) can carry it without importing the pass."""

from __future__ import annotations

import torch

from distrain.strategy.context_parallel import chunks


class SequenceSplit:
    """One cp rank's share of every sequence: chunks `rank` and 2·cp−1−`rank` of 2·cp."""

    def __init__(self, cp: int, rank: int):
        self.cp, self.rank = cp, rank
        self.seq_len: int | None = None  # of the last batch split: the positions follow it
        self._index: dict[tuple[int, torch.device], torch.Tensor] = {}

    def index(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """The positions of this rank's tokens in a sequence of `seq_len`, in the order it holds them."""
        key = (seq_len, device)
        if key not in self._index:
            front, back = chunks(seq_len, self.cp, self.rank)
            self._index[key] = torch.tensor([*front, *back], dtype=torch.long, device=device)
        return self._index[key]

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of each sequence of x (batch, seq_len, ...)."""
        self.seq_len = x.shape[1]
        return x[:, self.index(x.shape[1], x.device)]

    def positions(self, device: torch.device) -> torch.Tensor:
        assert self.seq_len is not None, "positions asked for before any batch was split"
        return self.index(self.seq_len, device)
